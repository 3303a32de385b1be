//! Partial selection of a row's best tokens (top-k, top-p, top logprobs)
//! without ever sorting V.
//!
//! Candidates are ranked by a total order — score descending, then token
//! id ascending — so top-k keeps exactly K tokens (ties at the K-th score
//! go to the lower ids) and no result depends on the selection algorithm's
//! internal order. The order is encoded in one `u64` key per candidate
//! (smaller = better), so selections and sorts compare plain integers.

use super::math;

/// A candidate: `(order-preserving score bits, negated) << 32 | id`.
pub(crate) type Cand = u64;

/// First candidate count tried by top-p; doubled while the candidates'
/// mass stays below `top_p`.
const TOP_P_FIRST: usize = 64;
/// Values tested at once against the cut-off of the candidate scan.
const SCAN_BLOCK: usize = 16;

/// The key of token `id` with score `s` (no NaN). `-0.0` is folded into
/// `+0.0` first so that it ties with it, as the float comparison does.
#[inline]
pub(crate) fn key(s: f32, id: u32) -> Cand {
    let b = (s + 0.0).to_bits();
    // Monotonic in s: flip negatives entirely, set the sign bit of others.
    let ord = if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    };
    (u64::from(!ord) << 32) | u64::from(id)
}

/// The score a key was made from.
#[inline]
pub(crate) fn score(k: Cand) -> f32 {
    let ord = !((k >> 32) as u32);
    let b = if ord & 0x8000_0000 != 0 {
        ord & 0x7FFF_FFFF
    } else {
        !ord
    };
    f32::from_bits(b)
}

/// The token id of a key.
#[inline]
pub(crate) fn id(k: Cand) -> u32 {
    k as u32
}

/// Leaves the `c` best candidates of `row` in `out`, unordered, in one
/// scan: a value enters the buffer only if it beats the current cut-off,
/// and the buffer is cut back to `c` by `select_nth_unstable` whenever it
/// fills. Ids are scanned in ascending order, so a later score equal to
/// the cut-off loses the tie, exactly as the key order says.
pub(crate) fn top_candidates(row: &[f32], c: usize, out: &mut Vec<Cand>) {
    out.clear();
    if c == 0 {
        return;
    }
    if c >= row.len() {
        out.extend(row.iter().enumerate().map(|(i, &s)| key(s, i as u32)));
        return;
    }
    // Cutting often keeps the cut-off close to the final one, so few values
    // enter at all: a cut costs O(c), and over a row only about
    // c·(1 + ln(V/c)) values beat a running cut-off.
    let cap = 2 * c + 8;
    // Until the first cut every value enters; afterwards only values above
    // the cut-off (the weakest kept score) can.
    let mut cutoff = f32::NEG_INFINITY;
    let mut have_cutoff = false;
    let mut base = 0usize;
    for block in row.chunks(SCAN_BLOCK) {
        // Most blocks hold nothing above the cut-off: one vectorised test
        // skips them whole.
        if have_cutoff && !block.iter().fold(false, |any, &s| any | (s > cutoff)) {
            base += block.len();
            continue;
        }
        for (j, &s) in block.iter().enumerate() {
            if have_cutoff && s <= cutoff {
                continue;
            }
            out.push(key(s, (base + j) as u32));
            if out.len() == cap {
                out.select_nth_unstable(c - 1);
                out.truncate(c);
                cutoff = score(out[c - 1]);
                have_cutoff = true;
            }
        }
        base += block.len();
    }
    if out.len() > c {
        out.select_nth_unstable(c - 1);
        out.truncate(c);
    }
}

/// The `c` best candidates, best first.
pub(crate) fn top_sorted(row: &[f32], c: usize, out: &mut Vec<Cand>) {
    top_candidates(row, c, out);
    out.sort_unstable();
}

/// Top-p over the full softmax (at temperature 1, max `m`) with positional
/// top-k folded in: in rank order, keep position j while j < `top_k` and
/// the exclusive cumulative probability is below `top_p`. Only a prefix is
/// ever sorted: the best 64 candidates first, doubled while their mass
/// does not reach `top_p`. Leaves the survivors in `out`, best first.
pub(crate) fn top_p_candidates(row: &[f32], m: f32, top_p: f32, top_k: usize, out: &mut Vec<Cand>) {
    let z = math::sum_exp(row, m, 1.0);
    let inv_z = 1.0 / z;
    let mut c = TOP_P_FIRST.min(top_k);
    loop {
        top_sorted(row, c, out);
        let mut cum = 0.0f32;
        let mut keep = out.len();
        for (j, &k) in out.iter().enumerate() {
            if cum >= top_p {
                keep = j;
                break;
            }
            cum += math::exp_approx(score(k) - m) * inv_z;
        }
        if keep < out.len() || c >= top_k {
            out.truncate(keep);
            return;
        }
        c = (2 * c).min(top_k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_order_by_score_then_id_and_round_trip() {
        let values = [
            f32::NEG_INFINITY,
            -3.3e38,
            -2.0,
            -1e-40,
            -0.0,
            0.0,
            1e-40,
            1.5,
            3.3e38,
        ];
        for w in values.windows(2) {
            if w[0] == w[1] {
                assert_eq!(key(w[0], 1) >> 32, key(w[1], 1) >> 32, "-0 ties with +0");
            } else {
                assert!(key(w[0], 0) > key(w[1], 0), "{} ranks below {}", w[0], w[1]);
            }
        }
        for &v in &values {
            assert_eq!(score(key(v, 9)), v + 0.0);
            assert_eq!(id(key(v, 9)), 9);
        }
        assert!(key(1.0, 3) < key(1.0, 4), "lower id first on ties");
    }

    #[test]
    fn top_candidates_keeps_exactly_k_with_lower_ids_on_ties() {
        let row: Vec<f32> = (0..1000).map(|i| (i % 7) as f32).collect();
        let mut out = Vec::new();
        top_candidates(&row, 5, &mut out);
        let mut ids: Vec<u32> = out.iter().map(|&k| id(k)).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![6, 13, 20, 27, 34]);
    }

    #[test]
    fn top_candidates_matches_a_full_sort() {
        let row: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 1013) as f32 * 0.01 - 3.0)
            .collect();
        let mut all: Vec<(f32, u32)> = row
            .iter()
            .enumerate()
            .map(|(i, &s)| (s, i as u32))
            .collect();
        all.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
        for c in [1, 40, 64, 300, 4999, 5000] {
            let mut out = Vec::new();
            top_sorted(&row, c, &mut out);
            let got: Vec<(f32, u32)> = out.iter().map(|&k| (score(k), id(k))).collect();
            assert_eq!(got, all[..c], "c = {c}");
        }
    }

    #[test]
    fn top_p_doubles_until_the_mass_is_reached() {
        // Flat row: top-p just under 0.5 over 1000 tokens needs 500
        // candidates, more than the first 64 and the doublings to 128, 256.
        let row = vec![0.0f32; 1000];
        let mut out = Vec::new();
        top_p_candidates(&row, 0.0, 0.4995, 1000, &mut out);
        assert_eq!(out.len(), 500);
        assert!(out.iter().all(|&k| id(k) < 500), "lower ids win ties");
        top_p_candidates(&row, 0.0, 0.4995, 100, &mut out);
        assert_eq!(out.len(), 100, "top-k bounds the doubling");
    }
}
