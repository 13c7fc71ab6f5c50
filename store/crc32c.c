/*
 * RocksDB's CRC32C, computed by ISA-L.
 *
 * RocksDB checksums every record of its write-ahead log and of its blob
 * files (where pages live) with CRC32C. Debian's librocksdb is built for any
 * x86-64 CPU, so it computes that CRC in software, with tables: under a
 * stream of Appends it was the largest single cost of kvdepotd (28 % of the
 * server's CPU in the flush thread's blob files alone, besides the log's,
 * computed before each reply). RocksDB reaches its CRC through one exported
 * function, rocksdb::crc32c::Extend(crc, data, n), which its code calls
 * through the dynamic linker; a definition in the executable comes first in
 * the lookup, so this file defines that function with ISA-L's crc32_iscsi
 * (the same polynomial; SSE4.2, PCLMUL or AVX-512 chosen at run time) and
 * RocksDB's calls land here. The values are the same CRC32C bit for bit
 * (test store_crc32c compares them with RocksDB's own function), so the
 * files stay readable by any RocksDB. Built when libisal is found; without
 * it RocksDB keeps its own CRC.
 */
#include "store.h"
#include "store_internal.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

static atomic_ullong calls;

uint64_t kvd__crc32c_calls(void)
{
    return atomic_load_explicit(&calls, memory_order_relaxed);
}

#ifdef KVD_HAVE_ISAL
#include <isa-l/crc.h>

/* rocksdb::crc32c::Extend(uint32_t, const char *, size_t): the CRC32C of
 * data following bytes whose CRC32C is crc. ISA-L's crc32_iscsi leaves out
 * CRC32C's inversions before and after; its length is an int. */
uint32_t kvd__crc32c_extend(uint32_t crc, const char *data,
                            size_t n) __asm__("_ZN7rocksdb6crc32c6ExtendEjPKcm");
uint32_t kvd__crc32c_extend(uint32_t crc, const char *data, size_t n)
{
    atomic_fetch_add_explicit(&calls, 1, memory_order_relaxed);
    unsigned int c = ~crc;
    while (n > 0) {
        const int len = n > ((size_t)1 << 30) ? 1 << 30 : (int)n;
        c = crc32_iscsi((unsigned char *)data, len, c);
        data += len;
        n -= (size_t)len;
    }
    return ~c;
}

const char *kvd_store_crc32c(void)
{
    return kvd__crc32c_calls() > 0 ? "isa-l" : "rocksdb";
}
#else
const char *kvd_store_crc32c(void)
{
    return "rocksdb";
}
#endif
