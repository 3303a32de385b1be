//! The per-row transform chain: what one row of logits becomes before a
//! token is drawn from it.
//!
//! Order (seed semantics): penalties → (top-p with top-k folded into the
//! same pass | top-k alone) → min-p → greedy argmax, or temperature and a
//! categorical draw. Top-p and min-p judge the penalised scores at
//! temperature 1; the temperature only shapes the final draw.
//!
//! Every function here works on one row with caller-owned scratch, so the
//! uniform path can run rows on several threads and the serial path one by
//! one with *the same code*; a row's result depends only on its logits,
//! its [`Plan`], its penalty window and its RNG.
//!
//! Candidates are ranked by a total order — score descending, then token
//! id ascending — so top-k keeps exactly K tokens (ties at the K-th score
//! go to the lower ids) and the result never depends on the selection
//! algorithm's internal order.

use std::cmp::Ordering;

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::math;
use super::SamplingOptions;

/// First candidate count tried by top-p; doubled while the candidates'
/// mass stays below `top_p`.
const TOP_P_FIRST: usize = 64;

/// The transforms of one slot, resolved from normalised options. Two slots
/// with equal plans produce identical tokens from identical inputs (their
/// seeds and logprob requests aside), which is what the uniform path needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Plan {
    /// 0 selects the argmax.
    pub temperature: f32,
    /// 0 = off; K ≥ V keeps everything.
    pub top_k: usize,
    /// Active in (0, 1); stored as 1 (off) otherwise.
    pub top_p: f32,
    /// Active in (0, 1]; stored as 0 (off) otherwise.
    pub min_p: f32,
    pub penalty: Penalty,
}

/// Penalty coefficients and window; `window == 0` means no penalty at all.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Penalty {
    pub repeat: f32,
    pub presence: f32,
    pub frequency: f32,
    pub window: usize,
}

impl Plan {
    /// Resolves options that went through [`SamplingOptions::normalized`].
    pub(crate) fn from_normalized(o: &SamplingOptions) -> Self {
        let window = o.window();
        Self {
            temperature: o.temperature,
            top_k: usize::try_from(o.top_k).unwrap_or(0),
            top_p: if o.top_p > 0.0 && o.top_p < 1.0 {
                o.top_p
            } else {
                1.0
            },
            min_p: if o.min_p > 0.0 && o.min_p <= 1.0 {
                o.min_p
            } else {
                0.0
            },
            penalty: if window == 0 {
                Penalty {
                    repeat: 1.0,
                    presence: 0.0,
                    frequency: 0.0,
                    window: 0,
                }
            } else {
                Penalty {
                    repeat: o.repeat_penalty,
                    presence: o.presence_penalty,
                    frequency: o.frequency_penalty,
                    window,
                }
            },
        }
    }

    /// Whether this slot keeps a penalty ring.
    pub(crate) fn uses_history(&self) -> bool {
        self.penalty.window > 0
    }

    pub(crate) fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Why a row could not be sampled; the caller adds the slot and row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum RowFault {
    /// A NaN or `+inf` logit.
    NonFinite,
    /// Every logit is `-inf` (before or after penalties).
    NoFiniteLogit,
    /// A history token does not index this vocabulary.
    TokenOutOfVocab(u32),
}

/// One row's inputs.
#[derive(Clone, Copy)]
pub(crate) struct RowJob<'a> {
    /// Raw logits of the row, length V ≥ 1.
    pub logits: &'a [f32],
    pub plan: &'a Plan,
    /// The tokens of the penalty window (any order; empty = no penalty).
    pub window: &'a [u32],
}

/// Reusable buffers of one worker; sized on first use, never shrunk.
#[derive(Debug, Default)]
pub(crate) struct RowScratch {
    /// Penalised copy of the row (untouched when no penalty applies).
    scores: Vec<f32>,
    /// Dense probabilities when no top-k / top-p bounds the candidates.
    dense: Vec<f32>,
    /// Candidate buffer of the partial selection, `(score, id)`.
    pairs: Vec<(f32, u32)>,
    /// Sorted copy of the penalty window.
    hist: Vec<u32>,
    /// Surviving candidates as `(id, probability)`, ids ascending.
    kept: Vec<(u32, f32)>,
}

/// What the chain left to draw from.
enum Outcome {
    Greedy(u32),
    /// `scratch.kept` holds the survivors.
    Sparse,
    /// `scratch.dense` holds a probability for every token.
    Dense,
}

/// Score descending, then id ascending: a total order on candidates (the
/// rows are NaN-free by the time anything is ranked).
#[inline]
fn rank(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.partial_cmp(&a.0)
        .unwrap_or(Ordering::Equal)
        .then(a.1.cmp(&b.1))
}

/// Leaves the `c` best candidates of `row` (by [`rank`]) in `pairs`,
/// unordered, in one scan: a candidate enters the buffer only if it beats
/// the current cut-off, and the buffer is cut back to `c` by
/// `select_nth_unstable_by` whenever it fills. Ids are scanned in
/// ascending order, so a later score equal to the cut-off loses the tie.
fn top_candidates(row: &[f32], c: usize, pairs: &mut Vec<(f32, u32)>) {
    pairs.clear();
    if c == 0 {
        return;
    }
    if c >= row.len() {
        pairs.extend(row.iter().enumerate().map(|(i, &s)| (s, i as u32)));
        return;
    }
    let cap = (4 * c).max(256);
    let mut cutoff = f32::NEG_INFINITY;
    let mut have_cutoff = false;
    for (i, &s) in row.iter().enumerate() {
        if have_cutoff && !(s > cutoff) {
            continue;
        }
        pairs.push((s, i as u32));
        if pairs.len() == cap {
            pairs.select_nth_unstable_by(c - 1, rank);
            pairs.truncate(c);
            cutoff = pairs[c - 1].0;
            have_cutoff = true;
        }
    }
    if pairs.len() > c {
        pairs.select_nth_unstable_by(c - 1, rank);
        pairs.truncate(c);
    }
}

/// Applies repeat / presence penalties once per distinct window token and
/// the frequency penalty once per occurrence (seed semantics).
fn apply_penalty(
    scores: &mut [f32],
    pen: &Penalty,
    window: &[u32],
    hist: &mut Vec<u32>,
) -> Result<(), RowFault> {
    hist.clear();
    hist.extend_from_slice(window);
    hist.sort_unstable();
    if let Some(&last) = hist.last() {
        if last as usize >= scores.len() {
            return Err(RowFault::TokenOutOfVocab(last));
        }
    }
    let mut i = 0;
    while i < hist.len() {
        let t = hist[i];
        let mut n = 1;
        while i + n < hist.len() && hist[i + n] == t {
            n += 1;
        }
        i += n;
        let slot = &mut scores[t as usize];
        let mut v = *slot;
        if pen.repeat != 1.0 {
            v = if v < 0.0 {
                v * pen.repeat
            } else {
                v / pen.repeat
            };
        }
        v -= pen.presence;
        v -= pen.frequency * n as f32;
        // A penalty below 1 or a negative coefficient could overflow to
        // +inf, which would poison the softmax.
        *slot = v.min(f32::MAX);
    }
    Ok(())
}

/// Runs the chain up to the point of drawing.
fn process(job: RowJob<'_>, scratch: &mut RowScratch) -> Result<Outcome, RowFault> {
    let RowScratch {
        scores: buf,
        dense,
        pairs,
        hist,
        kept,
    } = scratch;
    let plan = job.plan;
    let (raw_max, bad) = math::max_and_bad(job.logits);
    if bad {
        return Err(RowFault::NonFinite);
    }
    let (scores, m): (&[f32], f32) = if plan.uses_history() && !job.window.is_empty() {
        buf.clear();
        buf.extend_from_slice(job.logits);
        apply_penalty(buf, &plan.penalty, job.window, hist)?;
        let m = math::max(buf);
        (buf.as_slice(), m)
    } else {
        (job.logits, raw_max)
    };
    if m == f32::NEG_INFINITY {
        return Err(RowFault::NoFiniteLogit);
    }
    if plan.is_greedy() {
        // Every truncation keeps the first maximum, so it is the answer.
        return Ok(Outcome::Greedy(math::argmax(scores) as u32));
    }

    let v = scores.len();
    let top_k = if plan.top_k > 0 && plan.top_k < v {
        plan.top_k
    } else {
        v
    };
    let sparse = if plan.top_p < 1.0 {
        top_p_candidates(scores, m, plan.top_p, top_k, pairs);
        true
    } else if top_k < v {
        top_candidates(scores, top_k, pairs);
        true
    } else {
        false
    };
    let floor = if plan.min_p > 0.0 {
        m + plan.min_p.ln()
    } else {
        f32::NEG_INFINITY
    };
    // Guards a subnormal temperature: 0 × inf would be NaN.
    let inv_t = (1.0 / plan.temperature).min(f32::MAX);

    if sparse {
        kept.clear();
        kept.extend(
            pairs
                .iter()
                .filter(|(s, _)| *s >= floor)
                .map(|&(s, id)| (id, s)),
        );
        kept.sort_unstable_by_key(|&(id, _)| id);
        let mut z = 0.0f32;
        for (_, s) in kept.iter_mut() {
            *s = math::exp_approx((*s - m) * inv_t);
            z += *s;
        }
        let inv_z = 1.0 / z;
        for (_, w) in kept.iter_mut() {
            *w *= inv_z;
        }
        Ok(Outcome::Sparse)
    } else {
        dense.resize(v, 0.0);
        let z = math::exp_into(scores, m, inv_t, floor, dense);
        math::normalise(dense, z);
        Ok(Outcome::Dense)
    }
}

/// Top-p over the full softmax (at temperature 1) with positional top-k
/// folded in: in rank order, keep position j while j < `top_k` and the
/// exclusive cumulative probability is below `top_p`. Only a prefix is
/// ever sorted: the best 64 candidates first, doubled while their mass
/// does not reach `top_p`.
fn top_p_candidates(scores: &[f32], m: f32, top_p: f32, top_k: usize, pairs: &mut Vec<(f32, u32)>) {
    let z = math::sum_exp(scores, m, 1.0);
    let inv_z = 1.0 / z;
    let mut c = TOP_P_FIRST.min(top_k);
    loop {
        top_candidates(scores, c, pairs);
        pairs.sort_unstable_by(rank);
        let mut cum = 0.0f32;
        let mut keep = pairs.len();
        for (j, &(s, _)) in pairs.iter().enumerate() {
            if !(cum < top_p) {
                keep = j;
                break;
            }
            cum += math::exp_approx(s - m) * inv_z;
        }
        if keep < pairs.len() || c >= top_k {
            pairs.truncate(keep);
            return;
        }
        c = (2 * c).min(top_k);
    }
}

/// Draws one token for the row. Greedy rows use no randomness; any other
/// row consumes exactly one `f64` from `rng`, turned into a token by the
/// inverse CDF over the kept tokens in id order.
pub(crate) fn sample_row(
    job: RowJob<'_>,
    rng: &mut ChaCha8Rng,
    scratch: &mut RowScratch,
) -> Result<u32, RowFault> {
    let outcome = process(job, scratch)?;
    let pick = match outcome {
        Outcome::Greedy(t) => return Ok(t),
        Outcome::Sparse => {
            let u = rng.random::<f64>();
            math::inverse_cdf(u, scratch.kept.iter().map(|&(id, p)| (id as usize, p)))
        }
        Outcome::Dense => {
            let u = rng.random::<f64>();
            math::inverse_cdf(u, scratch.dense.iter().copied().enumerate())
        }
    };
    // The row maximum always keeps probability > 0, so this is a safeguard.
    pick.map(|i| i as u32).ok_or(RowFault::NoFiniteLogit)
}

/// Writes into `out` (length V) the distribution [`sample_row`] would draw
/// from: a one-hot on the argmax for greedy rows. Drawing from `out` with
/// [`math::inverse_cdf`] and the same uniform picks the same token.
pub(crate) fn distribution_row(
    job: RowJob<'_>,
    scratch: &mut RowScratch,
    out: &mut [f32],
) -> Result<(), RowFault> {
    match process(job, scratch)? {
        Outcome::Greedy(t) => {
            out.fill(0.0);
            out[t as usize] = 1.0;
        }
        Outcome::Sparse => {
            out.fill(0.0);
            for &(id, p) in &scratch.kept {
                out[id as usize] = p;
            }
        }
        Outcome::Dense => out.copy_from_slice(&scratch.dense),
    }
    Ok(())
}

/// Log-softmax of the raw row (stable: max subtracted first, along this
/// row only): returns the log-probability of `token` and fills `top` with
/// the `top.len()` most likely tokens, descending. The row must already
/// have passed [`sample_row`]'s checks.
pub(crate) fn logprobs_row(
    logits: &[f32],
    token: u32,
    top: &mut [(u32, f32)],
    scratch: &mut RowScratch,
) -> f32 {
    let m = math::max(logits);
    let lse = math::sum_exp(logits, m, 1.0).ln();
    let lp = |x: f32| (x - m) - lse;
    if !top.is_empty() {
        let k = top.len().min(logits.len());
        top_candidates(logits, k, &mut scratch.pairs);
        scratch.pairs.sort_unstable_by(rank);
        for (slot, &(s, id)) in top.iter_mut().zip(&scratch.pairs) {
            *slot = (id, lp(s));
        }
    }
    lp(logits[token as usize])
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn plan(o: SamplingOptions) -> Plan {
        Plan::from_normalized(&o.normalized(128))
    }

    #[test]
    fn top_candidates_keeps_exactly_k_with_lower_ids_on_ties() {
        let row: Vec<f32> = (0..1000).map(|i| (i % 7) as f32).collect();
        let mut pairs = Vec::new();
        top_candidates(&row, 5, &mut pairs);
        let mut ids: Vec<u32> = pairs.iter().map(|p| p.1).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![6, 13, 20, 27, 34]);
    }

    #[test]
    fn top_candidates_matches_a_full_sort() {
        let row: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 1013) as f32 * 0.01)
            .collect();
        let mut all: Vec<(f32, u32)> = row
            .iter()
            .enumerate()
            .map(|(i, &s)| (s, i as u32))
            .collect();
        all.sort_by(rank);
        for c in [1, 40, 64, 300, 4999, 5000] {
            let mut pairs = Vec::new();
            top_candidates(&row, c, &mut pairs);
            pairs.sort_by(rank);
            assert_eq!(pairs, all[..c], "c = {c}");
        }
    }

    #[test]
    fn penalty_counts_distinct_tokens_once_and_occurrences_for_frequency() {
        let mut s = vec![4.0, -2.0, 1.0];
        let pen = Penalty {
            repeat: 2.0,
            presence: 0.5,
            frequency: 0.25,
            window: 8,
        };
        apply_penalty(&mut s, &pen, &[0, 1, 0, 0], &mut Vec::new()).unwrap();
        assert_eq!(
            s,
            vec![4.0 / 2.0 - 0.5 - 0.75, -2.0 * 2.0 - 0.5 - 0.25, 1.0]
        );
        let err = apply_penalty(&mut s, &pen, &[3], &mut Vec::new());
        assert_eq!(err, Err(RowFault::TokenOutOfVocab(3)));
    }

    #[test]
    fn top_p_doubles_until_the_mass_is_reached() {
        // Flat row: top-p just under 0.5 over 1000 tokens needs 500 candidates, more
        // than the first 64 and the doublings to 128 and 256.
        let row = vec![0.0f32; 1000];
        let mut pairs = Vec::new();
        top_p_candidates(&row, 0.0, 0.4995, 1000, &mut pairs);
        assert_eq!(pairs.len(), 500);
        assert!(pairs.iter().all(|p| p.1 < 500), "lower ids win ties");
        top_p_candidates(&row, 0.0, 0.4995, 100, &mut pairs);
        assert_eq!(pairs.len(), 100, "top-k bounds the doubling");
    }

    #[test]
    fn sampling_equals_drawing_from_the_distribution() {
        let logits: Vec<f32> = (0..300).map(|i| ((i * 37) % 101) as f32 * 0.05).collect();
        for o in [
            SamplingOptions {
                temperature: 0.7,
                ..Default::default()
            },
            SamplingOptions {
                temperature: 1.3,
                top_k: 20,
                ..Default::default()
            },
            SamplingOptions {
                temperature: 1.0,
                top_p: 0.8,
                min_p: 0.05,
                ..Default::default()
            },
            SamplingOptions {
                temperature: 0.9,
                min_p: 0.2,
                ..Default::default()
            },
        ] {
            let p = plan(o);
            let job = RowJob {
                logits: &logits,
                plan: &p,
                window: &[],
            };
            let mut scratch = RowScratch::default();
            let mut dist = vec![0.0; logits.len()];
            distribution_row(job, &mut scratch, &mut dist).unwrap();
            let sum: f32 = dist.iter().sum();
            assert!((sum - 1.0).abs() < 1e-4, "{o:?}: sum {sum}");
            for seed in 0..50 {
                let mut a = ChaCha8Rng::seed_from_u64(seed);
                let mut b = a.clone();
                let t = sample_row(job, &mut a, &mut scratch).unwrap();
                let u = b.random::<f64>();
                let d = math::inverse_cdf(u, dist.iter().copied().enumerate()).unwrap();
                assert_eq!(t as usize, d, "{o:?} seed {seed}");
            }
        }
    }

    #[test]
    fn logprobs_are_a_stable_log_softmax() {
        let logits = [1000.0f32, 999.0, 998.0];
        let mut top = [(0u32, 0.0f32); 2];
        let lp = logprobs_row(&logits, 1, &mut top, &mut RowScratch::default());
        let z = 1.0f64 + (-1.0f64).exp() + (-2.0f64).exp();
        assert!((f64::from(lp) - (-1.0 - z.ln())).abs() < 1e-5);
        assert_eq!(top[0].0, 0);
        assert_eq!(top[1].0, 1);
        assert!((f64::from(top[0].1) + z.ln()).abs() < 1e-5);
    }
}
