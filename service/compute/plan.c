/*
 * PlanFetch: where to split a fetch between activations and K/V (KVPR), the
 * cost model of compute.h evaluated for a stored sequence.
 */
#include <math.h>
#include <string.h>

#include "compute_internal.h"
#include "validate.h"

double kvd_fetch_time(const kvd_fetch_cost *c, uint64_t l)
{
    double x = (double)l * c->x_bytes / c->bandwidth;
    double rc = (double)l * c->flops / c->rate;
    double kv = (double)(c->n - l) * c->kv_bytes / c->bandwidth;
    return x + (rc > kv ? rc : kv);
}

uint64_t kvd_plan_fetch(const kvd_fetch_cost *c)
{
    uint64_t hi = c->max_l < c->n ? c->max_l : c->n;
    uint64_t cand[4] = {0, hi, 0, 0};
    /* Recompute of l tokens takes as long as the transfer of the other n - l
     * at l* = n * (kv/bw) / (flops/rate + kv/bw). */
    double a = c->flops / c->rate, b = c->kv_bytes / c->bandwidth;
    double ls = a + b > 0 ? (double)c->n * b / (a + b) : 0.0;
    if (ls > (double)hi)
        ls = (double)hi;
    cand[2] = (uint64_t)floor(ls);
    cand[3] = cand[2] < hi ? cand[2] + 1 : cand[2];
    uint64_t best = 0;
    double tbest = kvd_fetch_time(c, 0);
    for (int i = 1; i < 4; i++) {
        double t = kvd_fetch_time(c, cand[i]);
        if (t < tbest || (t == tbest && cand[i] < best)) {
            tbest = t;
            best = cand[i];
        }
    }
    return best;
}

int kvd_compute_plan_fetch(const kvd_compute *c, const kvd_plan_args *a, kvd_plan *out,
                           kvd_error *err)
{
    memset(out, 0, sizeof *out);
    int rc;
    if (!(a->bandwidth > 0) || !isfinite(a->bandwidth))
        return kvd_error_set(err, KVD_EINVAL, "bandwidth_bytes_per_s: must be finite and > 0");
    if (!(a->flops > 0) || !isfinite(a->flops))
        return kvd_error_set(err, KVD_EINVAL, "compute_flops_per_s: must be finite and > 0");
    if ((rc = kvd_check_range(a->layer_start, a->num_layers, 32, "layer_start", "num_layers", err)))
        return rc;
    kvd__cseq sc;
    if ((rc = kvd__cseq_load(c, a->id, a->id_len, "sequence_id", 0, &sc, err)))
        return rc;
    if (a->layer_start >= sc.num_layers)
        return kvd_error_set(err, KVD_EINVAL, "layer_start %u: model %s has layers 0..%u",
                             a->layer_start, sc.model.name, sc.num_layers - 1);
    uint32_t L = a->num_layers ? a->num_layers : sc.num_layers - a->layer_start;
    if (L > sc.num_layers - a->layer_start)
        return kvd_error_set(err, KVD_EINVAL,
                             "num_layers %u from layer_start %u: model %s has layers 0..%u", L,
                             a->layer_start, sc.model.name, sc.num_layers - 1);
    const kvd_model_info *m = &sc.model;
    double es = (double)kvd_dtype_size(m->dtype);
    kvd_fetch_cost *k = &out->cost;
    k->n = sc.num_tokens;
    /* Stored page bytes are attributed per token and layer: pages of every
     * layer hold the same tokens, so the share of L layers is L / num_layers.
     * Stored activations are not K/V: they are left out. */
    k->kv_bytes = sc.num_tokens ? (double)(sc.stored_bytes - sc.activation_bytes) /
                                      (double)sc.num_tokens * L / sc.num_layers
                                : 0.0;
    k->x_bytes = (double)m->hidden_size * es * L;
    k->flops = 2.0 * m->hidden_size * (2.0 * m->num_kv_heads * m->head_dim) * L;
    k->bandwidth = a->bandwidth;
    k->rate = a->flops;
    /* Activations are only usable where the model declares a hidden size:
     * for every token when the caller says the receiver has them, else for
     * the leading tokens whose activations the sequence stores (an
     * activation-first Read serves exactly those). */
    k->max_l = !m->hidden_size               ? 0
               : a->assume_activations       ? k->n
               : sc.activation_tokens < k->n ? sc.activation_tokens
                                             : k->n;
    uint64_t l = kvd_plan_fetch(k);
    out->split_tokens = l;
    out->predicted_seconds = kvd_fetch_time(k, l);
    out->kv_only_seconds = kvd_fetch_time(k, 0);
    out->activation_bytes = (uint64_t)((double)l * k->x_bytes);
    out->kv_bytes = (uint64_t)((double)(k->n - l) * k->kv_bytes);
    out->recompute_seconds = (double)l * k->flops / k->rate;
    return 0;
}
