/*
 * Model artifacts: key smoothing factors, VQ codebooks, SVD rotations and
 * spectra, one f32 array per (kind, layer, kv head), persisted beside the
 * model record and removed with it.
 *
 * RocksDB key: 'A' u8 name_len name u8 kind be32 layer be32 kv_head, so one
 * model's artifacts are contiguous and iterate in (kind, layer, head) order.
 * Value: u8 version (1), u8 ndim (1 or 2), u32 shape[ndim] (LE), then
 * prod(shape) f32 little-endian.
 */
#ifndef KVDEPOT_STORE_ARTIFACT_H
#define KVDEPOT_STORE_ARTIFACT_H

#include <stddef.h>
#include <stdint.h>

#include "store.h"

/* Values equal the wire enum ArtifactKind. */
typedef enum kvd_artifact_kind {
    KVD_ARTIFACT_KEY_SMOOTHING = 1, /* (head_dim) */
    KVD_ARTIFACT_VQ_CODEBOOK_K = 2, /* (2^b, d), d in {2,4,8}, b in 4..12 */
    KVD_ARTIFACT_VQ_CODEBOOK_V = 3,
    KVD_ARTIFACT_SVD_ROTATION_K = 4, /* (head_dim, head_dim) */
    KVD_ARTIFACT_SVD_ROTATION_V = 5,
    KVD_ARTIFACT_SVD_SPECTRUM_K = 6, /* (head_dim) */
    KVD_ARTIFACT_SVD_SPECTRUM_V = 7,
} kvd_artifact_kind;
#define KVD_ARTIFACT_KIND_MAX 7

typedef struct kvd_artifact {
    int kind;
    uint32_t layer, kv_head;
    uint32_t ndim;
    uint32_t shape[2];
    float *data; /* prod(shape) values */
} kvd_artifact;

/* Check an artifact against the model: kind known, layer and head in range,
 * shape as listed above, every value finite. 0 or KVD_EINVAL. */
int kvd_artifact_validate(const kvd_model_info *m, const kvd_artifact *a, kvd_error *err);

/*
 * Store n artifacts of `model` in one write, replacing those of the same
 * (kind, layer, head). All are validated first: one bad artifact stores
 * none. 0, KVD_EINVAL, KVD_ENOTFOUND (model), or the write's error.
 */
int kvd_store_artifacts_put(kvd_store *st, const char *model, const kvd_artifact *a, size_t n,
                            kvd_error *err);

/*
 * The stored artifacts of `model` whose kind is among kinds[0..nkinds)
 * (all when nkinds == 0), in (kind, layer, head) order. *out is one
 * allocation freed with kvd_artifacts_free (NULL when *n == 0).
 * 0, KVD_ENOTFOUND, KVD_ECORRUPT, KVD_ENOMEM.
 */
int kvd_store_artifacts_get(kvd_store *st, const char *model, const int *kinds, size_t nkinds,
                            kvd_artifact **out, size_t *n, kvd_error *err);
void kvd_artifacts_free(kvd_artifact *a, size_t n);

/* Add to b the deletion of every artifact of `model` (model delete and
 * replace: artifacts describe one shape). */
struct rocksdb_writebatch_t;
void kvd__artifacts_delete_all(struct rocksdb_writebatch_t *b, const char *model);

#endif /* KVDEPOT_STORE_ARTIFACT_H */
