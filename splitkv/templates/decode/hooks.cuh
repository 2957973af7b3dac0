// splitkv decode program: the attention variant's hook points. The softmax step calls them at
// fixed places; DefaultVariant is plain attention, where every hook is the identity and compiles
// to nothing. A variant (soft-capping, a sliding window, attention sinks) is a struct of the same
// members, passed to the kernel as its template parameter.
#pragma once

namespace splitkv::decode {
struct DefaultVariant {
    // Score transform: a score as the softmax sees it (base 2: Q.K times the softmax scale and
    // log2 e, and for quantized K/V the K scale), of query head `qo_head` and token `token`.
    // A soft-cap `cap * tanh(s / cap)` goes here (in the base-2 units it is given).
    __device__ __forceinline__ static float transform_score(float score, int qo_head, int token) {
        (void)qo_head;
        (void)token;
        return score;
    }
    // Mask: false leaves the token out of the query head's softmax (probability 0), as a token past
    // the length is. A sliding window or a causal order among several query tokens goes here.
    __device__ __forceinline__ static bool keep_token(int qo_head, int token) {
        (void)qo_head;
        (void)token;
        return true;
    }
    // Extra softmax terms (attention sinks: one logit per query head that joins the denominator):
    // with EXTRA_TERMS, `extra_terms` receives the state (base-2 max m, sum l) of the one warp of
    // the row that holds its first token, once, after that warp's last tile, and returns the
    // factor by which that warp's O must be scaled (2^(m_old - m_new) when the term raises m).
    static constexpr bool EXTRA_TERMS = false;
    __device__ __forceinline__ static float extra_terms(int qo_head, float& m, float& l) {
        (void)qo_head;
        (void)m;
        (void)l;
        return 1.f;
    }
};
}  // namespace splitkv::decode
