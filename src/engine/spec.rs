//! Speculation rules: who drafts, how many drafts a sequence gets each step
//! ([`DraftPolicy`]), and how a step's drafts are verified ([`verify`]).
//!
//! Every step, sequences with speculation on draft `k_i` tokens with a
//! [`DraftHead`](super::DraftHead) (the rounds batched across those
//! sequences), then the step's single forward pass carries, for each of
//! them, its current token plus its drafts next to the plain decodes and
//! prefill chunks. Verification uses one rule for greedy and sampled
//! requests: with `p` the target's sampling distribution (after penalties
//! and truncation, from [`Sampler::speculative_distributions`]) and `q` the
//! draft's, draft `d` is accepted with probability `min(1, p(d) / q(d))`; on
//! rejection the token is drawn from the normalised residual `max(0, p − q)`;
//! when every draft is accepted a bonus token is drawn from the last `p`.
//! For greedy requests `p` and `q` are one-hot, so this reduces to "accept
//! the longest argmax-matching prefix, then the target's token", with no
//! randomness at all: greedy output is exactly plain greedy output. Plain
//! greedy requests (no penalty) take that shortcut literally: their drafts
//! and their verification come from [`Sampler::argmax_rows`] (ids only,
//! one kernel launch on a GPU) instead of full distributions.
//!
//! # Who decides the draft length
//! The scheduler plans `Decode { max_drafts }` inside the step's token
//! budget; [`DraftPolicy::drafts_for`] then takes at most that many, from
//! the sequence's schedule, the step's batch size and the measured cost of
//! drafting. A seeded sampled sequence is *pinned*: its drafts consume its
//! RNG, so its draft length may depend on nothing but its own history (the
//! scheduler reserves budget for its full schedule at admission).

use std::collections::HashMap;
use std::time::Duration;

use candle_core::Tensor;

use crate::engine::{DraftSchedule, SlotId, SpecOptions};
use crate::sampler::{Sampler, SamplerError, SamplingOptions, TokenMask};

/// Engine-wide speculation settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    /// What a request that does not say gets.
    pub default: SpecOptions,
    /// When more sequences than this decode in one step, nobody but pinned
    /// sequences drafts: a large batch is compute-bound, and drafts would
    /// cost more than they save.
    pub max_batch: usize,
    /// Test-only: accept every draft unchecked. This is a deliberately wrong
    /// rule; the distribution test uses it to show that it can fail. Debug
    /// builds only, so no release build carries the branch.
    #[cfg(debug_assertions)]
    #[doc(hidden)]
    pub unchecked_accept: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        Self {
            default: SpecOptions::default(),
            max_batch: 8,
            #[cfg(debug_assertions)]
            unchecked_accept: false,
        }
    }
}

/// How one sequence speculates, once resolved at admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drafting {
    pub options: SpecOptions,
    /// Seeded and sampled: drafts on its own schedule only (see the module
    /// docs), and the scheduler reserves its drafts in every step's budget.
    pub pinned: bool,
}

impl Drafting {
    /// The rule both sides apply: a sequence drafts when the engine has a
    /// draft head (`default` is its default options), its options (or the
    /// default) enable it, and it does not ask for logprobs (every logprob
    /// comes from a plain sampler call).
    pub fn resolve(
        requested: Option<SpecOptions>,
        default: Option<SpecOptions>,
        sampling: &SamplingOptions,
    ) -> Option<Self> {
        let default = default?;
        let options = requested.unwrap_or(default);
        (options.enabled && !sampling.logprobs).then(|| Self {
            options,
            pinned: !sampling.is_greedy() && sampling.seed.is_some(),
        })
    }

    /// Drafts the scheduler plans for this sequence in a step whose budget
    /// is `budget` tokens (one of them its own decode token).
    pub fn planned_drafts(&self, budget: usize) -> usize {
        self.options.max_draft.min(budget.saturating_sub(1))
    }
}

/// One sequence's draft schedule and back-off.
#[derive(Debug, Clone, Copy)]
struct SeqSchedule {
    drafting: Drafting,
    /// Draft length of the next speculative step.
    draft_len: usize,
    /// Speculative steps and tokens they produced, in the current window.
    window_steps: usize,
    window_tokens: usize,
    /// Decode steps left without drafting, and the next pause's length.
    paused: usize,
    backoff: usize,
}

/// Speculative steps per back-off decision.
const WINDOW_STEPS: usize = 8;
const MIN_BACKOFF: usize = 8;
const MAX_BACKOFF: usize = 256;

impl SeqSchedule {
    fn new(drafting: Drafting) -> Self {
        Self {
            drafting,
            draft_len: drafting.options.initial_draft.max(1),
            window_steps: 0,
            window_tokens: 0,
            paused: 0,
            backoff: MIN_BACKOFF,
        }
    }

    fn wanted(&mut self, step_allows: bool) -> usize {
        if self.drafting.pinned {
            return self.draft_len;
        }
        if !step_allows {
            return 0;
        }
        if self.paused > 0 {
            self.paused -= 1;
            return 0;
        }
        self.draft_len
    }

    /// The draft-length schedule, then the back-off against `cost` (what a
    /// speculative step costs relative to a plain one).
    fn record(&mut self, drafted: usize, accepted: usize, cost: f64) {
        if self.drafting.options.schedule == DraftSchedule::Heuristic {
            self.draft_len = if accepted == drafted {
                (self.draft_len + 2).min(self.drafting.options.max_draft)
            } else {
                self.draft_len.saturating_sub(1).max(1)
            };
        }
        if self.drafting.pinned {
            return;
        }
        self.window_steps += 1;
        self.window_tokens += 1 + accepted;
        if self.window_steps >= WINDOW_STEPS {
            let tokens_per_step = self.window_tokens as f64 / self.window_steps as f64;
            if tokens_per_step < cost {
                self.paused = self.backoff;
                self.backoff = (2 * self.backoff).min(MAX_BACKOFF);
            } else {
                self.backoff = MIN_BACKOFF;
            }
            self.window_steps = 0;
            self.window_tokens = 0;
        }
    }
}

/// Every decision about how many drafts a sequence gets: its schedule
/// (constant or heuristic), the batch-size cut, and the back-off while
/// drafting costs more than it yields. One store of the slot registry.
#[derive(Debug)]
pub(crate) struct DraftPolicy {
    max_batch: usize,
    /// Moving average of (draft + forward time) / forward time over steps
    /// that drafted: what a speculative step costs relative to a plain one.
    step_cost: f64,
    seqs: HashMap<SlotId, SeqSchedule>,
}

impl DraftPolicy {
    pub fn new(max_batch: usize) -> Self {
        Self {
            max_batch,
            step_cost: 1.0,
            seqs: HashMap::new(),
        }
    }

    pub fn admit(&mut self, slot: SlotId, drafting: Drafting) {
        self.seqs.insert(slot, SeqSchedule::new(drafting));
    }

    /// Forgets `slot` (it stops drafting); a no-op for an unknown slot.
    pub fn release(&mut self, slot: SlotId) {
        self.seqs.remove(&slot);
    }

    pub fn drafts(&self, slot: SlotId) -> bool {
        self.seqs.contains_key(&slot)
    }

    /// Whether a step with `decodes` decoding sequences lets unpinned
    /// sequences draft.
    pub fn step_allows(&self, decodes: usize) -> bool {
        decodes <= self.max_batch
    }

    /// Drafts `slot` takes this step: what its schedule wants, at most
    /// `allowed` (the plan's `max_drafts`, capped by the tokens it may still
    /// generate and the context). Advances the back-off clock only for a
    /// step in which it could have drafted.
    pub fn drafts_for(&mut self, slot: SlotId, allowed: usize, step_allows: bool) -> usize {
        match self.seqs.get_mut(&slot) {
            Some(s) if allowed > 0 => s.wanted(step_allows).min(allowed),
            _ => 0,
        }
    }

    /// After a speculative step of `slot` that accepted `accepted` of `drafted`.
    pub fn record(&mut self, slot: SlotId, drafted: usize, accepted: usize) {
        let cost = self.step_cost;
        if let Some(s) = self.seqs.get_mut(&slot) {
            s.record(drafted, accepted, cost);
        }
    }

    /// After a step that drafted: folds its cost into the average.
    pub fn record_step_cost(&mut self, draft: Duration, forward: Duration) {
        let forward = forward.as_secs_f64().max(1e-9);
        let ratio = (draft.as_secs_f64() + forward) / forward;
        self.step_cost = 0.8 * self.step_cost + 0.2 * ratio;
    }
}

/// Drafts chosen for one sequence and the draft distributions they came from.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Drafts {
    pub tokens: Vec<u32>,
    /// `q_i`: what draft i was drawn from (one-hot for greedy requests;
    /// empty for plain greedy ones, which verify from ids alone).
    pub probs: Vec<Vec<f32>>,
}

fn argmax(p: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in p.iter().enumerate() {
        if v > p[best] {
            best = i;
        }
    }
    best as u32
}

/// Picks a token from a distribution the way the request samples: greedy
/// requests take the argmax (no randomness), others draw with their RNG.
pub(crate) fn pick(
    sampler: &mut Sampler,
    slot: SlotId,
    greedy: bool,
    dist: &[f32],
) -> Result<u32, SamplerError> {
    if greedy {
        Ok(argmax(dist))
    } else {
        sampler.draw(slot, dist)
    }
}

/// The verdict on one sequence's drafts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub accepted: usize,
    /// The target's token after the accepted drafts (a correction or the bonus).
    pub next: u32,
}

/// Accepts the longest prefix of `drafts` equal to the target's greedy
/// choices `target[i]` (row i predicts the token after draft i), then takes
/// the target's own token: the rule for one-hot `p` and `q`.
pub(crate) fn verify_greedy(drafts: &[u32], target: &[u32]) -> Verdict {
    let accepted = drafts
        .iter()
        .zip(target)
        .take_while(|(d, a)| d == a)
        .count();
    Verdict {
        accepted,
        next: target[accepted],
    }
}

/// Where the sampled rule stops: the first rejected draft (whose token is
/// drawn from `residual` or, when that is all zero, from `p`), or none.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Rejection {
    At { index: usize, residual: Vec<f32> },
    None,
}

/// The sampled rule over explicit distributions: draft `d_i` (drawn from
/// `q[i]`) is accepted with probability `min(1, p[i][d_i] / q[i][d_i])`,
/// with `uniform` asked only when that probability is strictly between 0
/// and 1.
pub(crate) fn first_rejection(
    drafts: &[u32],
    q: &[Vec<f32>],
    p: &[Vec<f32>],
    mut uniform: impl FnMut() -> Result<f32, SamplerError>,
) -> Result<Rejection, SamplerError> {
    for (i, (&d, qi)) in drafts.iter().zip(q).enumerate() {
        let (pd, qd) = (p[i][d as usize], qi[d as usize]);
        let accept = if pd >= qd {
            true
        } else if pd <= 0.0 {
            false
        } else {
            uniform()? < pd / qd
        };
        if !accept {
            let residual = p[i].iter().zip(qi).map(|(a, b)| (a - b).max(0.0)).collect();
            return Ok(Rejection::At { index: i, residual });
        }
    }
    Ok(Rejection::None)
}

/// Verifies `drafts` against the target's logits `[k + 1, vocab]` (row i
/// predicts the token after draft i, row 0 after the current token).
/// Commits nothing.
pub(crate) fn verify(
    sampler: &mut Sampler,
    slot: SlotId,
    greedy: bool,
    logits: &Tensor,
    drafts: &Drafts,
    masks: Option<&[TokenMask]>,
    accept_all: bool,
) -> Result<Verdict, SamplerError> {
    let k = drafts.tokens.len();
    if greedy && masks.is_none() && sampler.is_plain_greedy(slot) {
        // Only the ids are needed (on a GPU only they leave the device).
        let ids = sampler.argmax_rows(&vec![slot; k + 1], logits)?;
        if accept_all {
            return Ok(Verdict {
                accepted: k,
                next: ids[k],
            });
        }
        return Ok(verify_greedy(&drafts.tokens, &ids));
    }
    // Under a grammar, position i's distribution is the masked one sequential
    // decoding would draw from, so greedy output equals MTP off.
    let p = sampler.speculative_distributions_masked(
        slot,
        logits,
        &drafts.tokens,
        masks.unwrap_or_default(),
    )?;
    if greedy && masks.is_some() {
        // One-hot rows: the greedy rule on their ids (plain greedy drafts
        // carry no draft distribution to compare with).
        let ids: Vec<u32> = p.iter().map(|row| argmax(row)).collect();
        if accept_all {
            return Ok(Verdict {
                accepted: k,
                next: ids[k],
            });
        }
        return Ok(verify_greedy(&drafts.tokens, &ids));
    }
    let rejection = if accept_all {
        Rejection::None
    } else {
        first_rejection(&drafts.tokens, &drafts.probs, &p, || sampler.uniform(slot))?
    };
    match rejection {
        Rejection::At { index, residual } => {
            let dist = if residual.iter().any(|&r| r > 0.0) {
                &residual
            } else {
                &p[index]
            };
            Ok(Verdict {
                accepted: index,
                next: pick(sampler, slot, greedy, dist)?,
            })
        }
        Rejection::None => Ok(Verdict {
            accepted: k,
            next: pick(sampler, slot, greedy, &p[k])?,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_verification_table() {
        // (drafts, target argmax per row, accepted, next)
        let table: &[(&[u32], &[u32], usize, u32)] = &[
            (&[], &[7], 0, 7),                 // plain decode: the bonus is the target's
            (&[5], &[5, 9], 1, 9),             // all accepted: bonus from the last row
            (&[5], &[6, 9], 0, 6),             // first rejected: the target's correction
            (&[1, 2, 3], &[1, 2, 3, 4], 3, 4), // full run
            (&[1, 2, 3], &[1, 8, 3, 4], 1, 8), // a later match does not count
            (&[1, 2, 3], &[9, 2, 3, 4], 0, 9), // nothing accepted
            (&[4, 4, 4], &[4, 4, 5, 6], 2, 5), // repeats are fine
        ];
        for &(drafts, target, accepted, next) in table {
            assert_eq!(
                verify_greedy(drafts, target),
                Verdict { accepted, next },
                "drafts {drafts:?} against {target:?}"
            );
        }
    }

    fn no_uniform() -> Result<f32, SamplerError> {
        panic!("the rule must not draw when min(1, p/q) is 0 or 1")
    }

    #[test]
    fn sampled_rule_table() {
        let p = |v: &[f32]| v.to_vec();
        // p ≥ q on the draft: accepted without a draw.
        let r = first_rejection(
            &[0],
            &[p(&[0.5, 0.5])],
            &[p(&[0.6, 0.4]), p(&[1.0, 0.0])],
            no_uniform,
        );
        assert_eq!(r.unwrap(), Rejection::None);
        // p = 0 on the draft: rejected without a draw; the residual is p − q clipped.
        let r = first_rejection(
            &[1],
            &[p(&[0.5, 0.5])],
            &[p(&[1.0, 0.0]), p(&[1.0, 0.0])],
            no_uniform,
        );
        assert_eq!(
            r.unwrap(),
            Rejection::At {
                index: 0,
                residual: vec![0.5, 0.0]
            }
        );
        // 0 < p/q < 1: the uniform decides (0.25 < 0.5 accepts, 0.75 rejects).
        let (q, pt) = (
            vec![p(&[0.25, 0.75])],
            vec![p(&[0.625, 0.375]), p(&[0.5, 0.5])],
        );
        assert_eq!(
            first_rejection(&[1], &q, &pt, || Ok(0.25)).unwrap(),
            Rejection::None
        );
        assert_eq!(
            first_rejection(&[1], &q, &pt, || Ok(0.75)).unwrap(),
            Rejection::At {
                index: 0,
                residual: vec![0.375, 0.0]
            }
        );
        // The first rejection ends the run even if later drafts would pass.
        let q = vec![p(&[1.0, 0.0]), p(&[1.0, 0.0])];
        let pt = vec![p(&[1.0, 0.0]), p(&[0.0, 1.0]), p(&[1.0, 0.0])];
        match first_rejection(&[0, 0], &q, &pt, no_uniform).unwrap() {
            Rejection::At { index, .. } => assert_eq!(index, 1),
            other => panic!("expected a rejection at 1, got {other:?}"),
        }
    }

    fn drafting(pinned: bool, schedule: DraftSchedule) -> Drafting {
        Drafting {
            options: SpecOptions {
                enabled: true,
                initial_draft: 2,
                max_draft: 6,
                schedule,
            },
            pinned,
        }
    }

    #[test]
    fn heuristic_schedule_table() {
        // (drafted, accepted) per step → draft length wanted next.
        let steps: &[((usize, usize), usize)] = &[
            ((2, 2), 4), // all accepted: +2
            ((4, 4), 6),
            ((6, 6), 6), // capped at max_draft
            ((6, 3), 5), // a mismatch: −1
            ((5, 0), 4),
            ((4, 0), 3),
            ((3, 0), 2),
            ((2, 0), 1),
            ((1, 0), 1), // never below 1
        ];
        let mut policy = DraftPolicy::new(8);
        policy.admit(0, drafting(true, DraftSchedule::Heuristic));
        assert_eq!(policy.drafts_for(0, 32, true), 2, "starts at initial_draft");
        for &((drafted, accepted), next) in steps {
            policy.record(0, drafted, accepted);
            assert_eq!(
                policy.drafts_for(0, 32, true),
                next,
                "after {accepted}/{drafted}"
            );
        }
        // The plan's cap always wins.
        assert_eq!(policy.drafts_for(0, 0, true), 0);
    }

    #[test]
    fn constant_schedule_and_the_cuts() {
        let mut policy = DraftPolicy::new(4);
        policy.admit(1, drafting(false, DraftSchedule::Constant));
        policy.admit(2, drafting(true, DraftSchedule::Constant));
        policy.record(1, 2, 0);
        assert_eq!(
            policy.drafts_for(1, 32, true),
            2,
            "constant ignores acceptance"
        );
        assert!(policy.step_allows(4) && !policy.step_allows(5));
        // A big batch stops unpinned sequences only.
        assert_eq!(policy.drafts_for(1, 32, false), 0);
        assert_eq!(policy.drafts_for(2, 32, false), 2);
        assert_eq!(policy.drafts_for(2, 1, false), 1, "never more than allowed");
        // Unknown or released slots never draft.
        policy.release(2);
        assert_eq!(policy.drafts_for(2, 32, true), 0);
    }

    #[test]
    fn back_off_pauses_unpinned_sequences_while_drafts_do_not_pay() {
        let mut policy = DraftPolicy::new(8);
        policy.admit(1, drafting(false, DraftSchedule::Constant));
        policy.admit(2, drafting(true, DraftSchedule::Constant));
        // Drafting costs 3× a plain step but yields 1 token per step.
        for _ in 0..4 {
            policy.record_step_cost(Duration::from_millis(20), Duration::from_millis(10));
        }
        for _ in 0..WINDOW_STEPS {
            policy.record(1, 2, 0);
            policy.record(2, 2, 0);
        }
        for _ in 0..MIN_BACKOFF {
            assert_eq!(policy.drafts_for(1, 32, true), 0, "paused");
            assert_eq!(policy.drafts_for(2, 32, true), 2, "pinned never pauses");
        }
        assert_eq!(
            policy.drafts_for(1, 32, true),
            2,
            "probes again after the pause"
        );
    }

    #[test]
    fn who_drafts() {
        let on = Some(SpecOptions::default());
        let greedy = SamplingOptions::greedy();
        let seeded = SamplingOptions {
            temperature: 0.8,
            seed: Some(3),
            ..Default::default()
        };
        let logprobs = SamplingOptions {
            logprobs: true,
            ..SamplingOptions::greedy()
        };
        assert_eq!(Drafting::resolve(None, None, &greedy), None, "no head");
        assert!(!Drafting::resolve(None, on, &greedy).unwrap().pinned);
        assert!(Drafting::resolve(None, on, &seeded).unwrap().pinned);
        assert_eq!(Drafting::resolve(None, on, &logprobs), None);
        assert_eq!(
            Drafting::resolve(Some(SpecOptions::off()), on, &greedy),
            None
        );
        let d = Drafting::resolve(Some(SpecOptions::constant(5)), on, &greedy).unwrap();
        assert_eq!(
            (
                d.planned_drafts(64),
                d.planned_drafts(3),
                d.planned_drafts(0)
            ),
            (5, 2, 0)
        );
    }
}
