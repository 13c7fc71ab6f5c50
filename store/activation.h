/*
 * Activation storage (KVPR): the layer inputs X of a sequence's tokens,
 * kept beside its K/V pages so a reader can fetch X for the first tokens and
 * recompute their K = X W_K, V = X W_V while the K/V of the rest streams in.
 *
 * A sequence stores activations only when it was created with
 * store_activations (kvd_store_seq_create_ex writes its counts with the
 * sequence record; kvd_store_seq_activations_enable turns them on for a
 * sequence that holds no tokens yet);
 * its model must declare a hidden_size. Per layer the store keeps the count
 * of leading tokens with activations: an Append carrying X extends it and is
 * accepted only when it starts exactly there (every earlier token of the
 * layer has X); an Append without X leaves it where it was, so it stops
 * growing for good on that layer. SequenceInfo's activation_tokens is the
 * minimum over the layers.
 *
 * RocksDB records (store_internal.h keys), little-endian unless noted:
 *
 *   'a' id                      u8 version (1) | u32 num_layers |
 *                               num_layers x u64 activation tokens
 *   'x' be16 id_len id be32 layer be64 token_start
 *                               X of tokens [token_start, token_start + n)
 *                               of the layer, [token][hidden_size] in the
 *                               model dtype, then u64 XXH3-64 of those bytes
 *                               seeded with (layer << 48) ^ token_start
 *
 * A data record holds the tokens of one Append that fall in one page block
 * (B tokens), so it never spans a block boundary and n follows from its
 * length. The Append that completes a block rewrites the records of the
 * earlier appends into it as one record for the whole block (decode steps of
 * one token each leave one record per sealed block, not B). The length
 * prefix of the id keeps one sequence's records apart from those of an id
 * extending it, so a sequence's records are one key range. Records are
 * written in the Append's WriteBatch (with its pages and sequence record: all
 * or nothing) and removed with the sequence in the delete's batch
 * (DeleteSequence, TTL expiry, the disk limit of a pure cache, model
 * deletion). Activation bytes count in stored_bytes, the tenants' byte quotas
 * and the disk limit.
 */
#ifndef KVDEPOT_STORE_ACTIVATION_H
#define KVDEPOT_STORE_ACTIVATION_H

#include "store.h"

/* Start storing activations for a sequence just created (no tokens on any
 * layer yet). KVD_ENOTFOUND (sequence), KVD_EPRECOND when the model has no
 * hidden_size or the sequence already holds tokens (a sequence created from a
 * shared prefix cannot store activations: they must start at token 0). */
int kvd_store_seq_activations_enable(kvd_store *st, const void *id, size_t id_len, kvd_error *err);

#endif /* KVDEPOT_STORE_ACTIVATION_H */
