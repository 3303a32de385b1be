//! The per-row transform chain: what one row of logits becomes before a
//! token is drawn from it.
//!
//! Order (Ollama's sampler's, which Tandem's reproduces): penalties → (top-p with top-k folded into the
//! same pass | top-k alone) → min-p → greedy argmax, or temperature and a
//! categorical draw. Top-p and min-p judge the penalised scores at
//! temperature 1; the temperature only shapes the final draw.
//!
//! Every function here works on one row with caller-owned scratch, so the
//! uniform path can run rows on several threads and the serial path one by
//! one with *the same code*; a row's result depends only on its logits,
//! its [`Plan`], its penalty window and its RNG.
//! Candidate selection and its tie rule live in `select.rs`.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::adjust::RowAdjust;
use super::draw;
use super::math;
use super::select::{self, Cand};
use super::SamplingOptions;

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
    /// The slot's logit bias and this step's grammar mask, applied first.
    pub adjust: RowAdjust<'a>,
}

/// Reusable buffers of one worker; sized on first use, never shrunk.
#[derive(Debug, Default)]
pub(crate) struct RowScratch {
    /// Penalised copy of the row (untouched when no penalty applies).
    scores: Vec<f32>,
    /// Dense probabilities when no top-k / top-p bounds the candidates.
    dense: Vec<f32>,
    /// Candidate buffer of the partial selection.
    pairs: Vec<Cand>,
    /// Sorted copy of the penalty window.
    hist: Vec<u32>,
    /// Surviving candidates as `(id, probability)`, ids ascending.
    kept: Vec<(u32, f32)>,
    /// Block sums of the categorical walk.
    dense_blocks: Vec<f64>,
    sparse_blocks: Vec<(usize, usize, f64)>,
}

/// What the chain left to draw from.
enum Outcome {
    Greedy(u32),
    /// `scratch.kept` holds the survivors.
    Sparse,
    /// `scratch.dense` holds a probability for every token.
    Dense,
}

/// Applies repeat / presence penalties once per distinct window token and
/// the frequency penalty once per occurrence of it in the window. `raw_max`
/// is the row's maximum before; returns the maximum after, rescanning the
/// row only when a penalised token held the old maximum (otherwise some
/// untouched token still does).
fn apply_penalty(
    scores: &mut [f32],
    pen: &Penalty,
    window: &[u32],
    hist: &mut Vec<u32>,
    raw_max: f32,
) -> Result<f32, RowFault> {
    hist.clear();
    hist.extend_from_slice(window);
    hist.sort_unstable();
    if let Some(&last) = hist.last() {
        if last as usize >= scores.len() {
            return Err(RowFault::TokenOutOfVocab(last));
        }
    }
    let mut touched_max = false;
    let mut new_max = f32::NEG_INFINITY;
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
        touched_max |= v == raw_max;
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
        new_max = new_max.max(*slot);
    }
    Ok(if touched_max {
        math::max(scores)
    } else {
        raw_max.max(new_max)
    })
}

/// Runs the chain up to the point of drawing: bias and mask, penalties,
/// truncation.
fn process(job: RowJob<'_>, scratch: &mut RowScratch) -> Result<Outcome, RowFault> {
    let RowScratch {
        scores: buf,
        dense,
        pairs,
        hist,
        kept,
        ..
    } = scratch;
    let plan = job.plan;
    let (raw_max, bad) = math::max_and_bad(job.logits);
    if bad {
        return Err(RowFault::NonFinite);
    }
    let penalised = plan.uses_history() && !job.window.is_empty();
    let (scores, m): (&[f32], f32) = if penalised || !job.adjust.is_identity() {
        buf.clear();
        buf.extend_from_slice(job.logits);
        let mut m = raw_max;
        if !job.adjust.is_identity() {
            job.adjust.apply(buf).map_err(RowFault::TokenOutOfVocab)?;
            m = math::max(buf);
        }
        if penalised {
            m = apply_penalty(buf, &plan.penalty, job.window, hist, m)?;
        }
        (buf.as_slice(), m)
    } else {
        (job.logits, raw_max)
    };
    if m == f32::NEG_INFINITY {
        return Err(RowFault::NoFiniteLogit);
    }
    if plan.is_greedy() {
        // Every truncation keeps the first maximum, so it is the answer.
        return Ok(Outcome::Greedy(math::first_index_of(scores, m) as u32));
    }

    let v = scores.len();
    let top_k = if plan.top_k > 0 && plan.top_k < v {
        plan.top_k
    } else {
        v
    };
    let sparse = if plan.top_p < 1.0 {
        select::top_p_candidates(scores, m, plan.top_p, top_k, pairs);
        true
    } else if top_k < v {
        select::top_candidates(scores, top_k, pairs);
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
                .map(|&c| (select::id(c), select::score(c)))
                .filter(|&(_, s)| s >= floor),
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
            draw::draw_sparse(u, &scratch.kept, &mut scratch.sparse_blocks)
        }
        Outcome::Dense => {
            let u = rng.random::<f64>();
            draw::draw_dense(u, &scratch.dense, &mut scratch.dense_blocks)
        }
    };
    // The row maximum always keeps probability > 0, so this is a safeguard.
    pick.map(|i| i as u32).ok_or(RowFault::NoFiniteLogit)
}

/// Writes into `out` (length V) the distribution [`sample_row`] would draw
/// from: a one-hot on the argmax for greedy rows. Drawing from `out` with
/// [`draw::draw_dense`] and the same uniform picks the same token.
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
        select::top_sorted(logits, k, &mut scratch.pairs);
        for (slot, &c) in top.iter_mut().zip(&scratch.pairs) {
            *slot = (select::id(c), lp(select::score(c)));
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
    fn penalty_counts_distinct_tokens_once_and_occurrences_for_frequency() {
        let mut s = vec![4.0, -2.0, 1.0];
        let pen = Penalty {
            repeat: 2.0,
            presence: 0.5,
            frequency: 0.25,
            window: 8,
        };
        let m = apply_penalty(&mut s, &pen, &[0, 1, 0, 0], &mut Vec::new(), 4.0).unwrap();
        assert_eq!(
            s,
            vec![4.0 / 2.0 - 0.5 - 0.75, -2.0 * 2.0 - 0.5 - 0.25, 1.0]
        );
        assert_eq!(m, 1.0, "the old maximum was penalised: rescanned");
        let err = apply_penalty(&mut s, &pen, &[3], &mut Vec::new(), 1.0);
        assert_eq!(err, Err(RowFault::TokenOutOfVocab(3)));
    }

    #[test]
    fn penalty_maximum_without_rescan() {
        let pen = Penalty {
            repeat: 1.0,
            presence: -3.0,
            frequency: 0.0,
            window: 8,
        };
        // Untouched maximum 5 stays, unless a boosted token overtakes it.
        let mut s = vec![5.0, 1.0, 2.5];
        assert_eq!(
            apply_penalty(&mut s, &pen, &[1], &mut Vec::new(), 5.0),
            Ok(5.0)
        );
        assert_eq!(
            apply_penalty(&mut s, &pen, &[2], &mut Vec::new(), 5.0),
            Ok(5.5)
        );
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
                adjust: RowAdjust::default(),
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
                let d = draw::draw_dense(u, &dist, &mut Vec::new()).unwrap();
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
