/*
 * kvd_prefix_hash: the documented kvdepot prefix hash, computed straight from
 * libxxhash so that interop clients without an xxh3 binding (Node) can check
 * the server's block hashes against an implementation that shares no code
 * with kvdepot.
 *
 * Input on stdin, whitespace separated decimal numbers:
 *     page_tokens  [seed]  t_0 t_1 ... t_{n-1}
 * where the first number is PAGE_TOKENS (B) and the token ids follow. With
 * "-s" as the first argument the second number is the parent hash to chain
 * from (h_{-1}); otherwise h_{-1} = 0.
 * Output: one line per complete block, its hash as an unsigned decimal:
 *     h_i = XXH3_64bits_withSeed(le32(t_{iB}) .. le32(t_{iB+B-1}), 4B, h_{i-1})
 * Exit status 0 on success, 2 on malformed input.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static int read_u64(uint64_t *out)
{
    char buf[32];
    if (scanf("%31s", buf) != 1)
        return 0;
    char *end = NULL;
    unsigned long long v = strtoull(buf, &end, 10);
    if (*end != '\0' || buf[0] == '-')
        return -1;
    *out = v;
    return 1;
}

int main(int argc, char **argv)
{
    int with_seed = argc > 1 && strcmp(argv[1], "-s") == 0;
    uint64_t page_tokens = 0, seed = 0;
    if (read_u64(&page_tokens) != 1 || page_tokens == 0 || page_tokens > (1u << 20)) {
        fprintf(stderr, "kvd_prefix_hash: expected page_tokens first\n");
        return 2;
    }
    if (with_seed && read_u64(&seed) != 1) {
        fprintf(stderr, "kvd_prefix_hash: expected the parent hash after page_tokens\n");
        return 2;
    }
    /* One block of token ids, little-endian uint32 each. */
    unsigned char *block = malloc(4 * page_tokens);
    if (block == NULL)
        return 2;
    uint64_t filled = 0, v = 0;
    int rc;
    while ((rc = read_u64(&v)) == 1) {
        if (v > UINT32_MAX) {
            fprintf(stderr, "kvd_prefix_hash: token id %" PRIu64 " exceeds uint32\n", v);
            free(block);
            return 2;
        }
        unsigned char *p = block + 4 * filled;
        p[0] = (unsigned char)(v & 0xff);
        p[1] = (unsigned char)((v >> 8) & 0xff);
        p[2] = (unsigned char)((v >> 16) & 0xff);
        p[3] = (unsigned char)((v >> 24) & 0xff);
        if (++filled == page_tokens) {
            seed = XXH3_64bits_withSeed(block, 4 * page_tokens, seed);
            printf("%" PRIu64 "\n", seed);
            filled = 0;
        }
    }
    free(block);
    if (rc < 0) {
        fprintf(stderr, "kvd_prefix_hash: malformed number on stdin\n");
        return 2;
    }
    return 0;
}
