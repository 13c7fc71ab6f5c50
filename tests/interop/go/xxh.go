package main

// The hashes kvdepot documents, from libxxhash itself (Debian libxxhash-dev):
// the prefix hash of the .proto and the page checksum of docs/page-format.md.

// #cgo LDFLAGS: -lxxhash
// #include <stddef.h>
// #include <stdint.h>
// #include <xxhash.h>
//
// static uint64_t h3(const void *p, size_t n, uint64_t seed) {
//     return XXH3_64bits_withSeed(n ? p : "", n, seed);
// }
import "C"

import "unsafe"

func xxh3(b []byte, seed uint64) uint64 {
	var p unsafe.Pointer
	if len(b) > 0 {
		p = unsafe.Pointer(&b[0])
	}
	return uint64(C.h3(p, C.size_t(len(b)), C.uint64_t(seed)))
}

// prefixChain is h_i = xxh3-64(le32 ids of block i, seed h_{i-1}), h_{-1} =
// parent, for every complete block of ids.
func prefixChain(ids []uint32, pageTokens int, parent uint64) []uint64 {
	var out []uint64
	buf := make([]byte, 4*pageTokens)
	for i := 0; i+pageTokens <= len(ids); i += pageTokens {
		for j := 0; j < pageTokens; j++ {
			putU32(buf[4*j:], ids[i+j])
		}
		parent = xxh3(buf, parent)
		out = append(out, parent)
	}
	return out
}

// pageChecksum is XXH3-64 (seed 0) over bytes [0, 56) and [64, len) of a page.
func pageChecksum(page []byte) uint64 {
	b := make([]byte, 0, len(page)-8)
	b = append(b, page[:56]...)
	b = append(b, page[64:]...)
	return xxh3(b, 0)
}
