//! The draft policy: how many drafts each sequence gets this step, and from
//! which drafter, chosen to maximise the step's expected tokens per unit of
//! time.
//!
//! # The model
//! - **Acceptance** per sequence and drafter (prompt lookup per match
//!   order): the chance that draft `j` is
//!   accepted given drafts `1..j` were, by position, from recent
//!   verifications (decayed counts with a weak prior: for the draft head,
//!   what it did for every sequence lately, so a new sequence starts where
//!   its predecessors left off rather than at a guess; prompt lookup's
//!   acceptance belongs to the text being copied, so its prior is fixed).
//!   A run of `k` drafts then yields `1 + Σ_{j≤k} Π_{l≤j} a_l` tokens in
//!   expectation.
//! - **Cost**: the time of a decode step's pass (forward, sampling,
//!   verification, update; steps with prompt chunks are left out, their
//!   tokens are cheaper at the margin) as a function of its tokens `F(T)`,
//!   and one draft round's time as a function of the rows it feeds the
//!   head, `R(M) = r0 + r1·M` (a member feeds one; in round 0 it feeds the
//!   pairs the head has not consumed, a few in steady drafting but its
//!   whole history when it resumes drafting: as a function of members,
//!   those catch-up rounds taught the policy that every round costs
//!   several, so it stopped drafting and caught up again at the next probe;
//!   on the H200 a single stream then drafted in fits), both measured
//!   online from the engine's own steps. The plan prices a member's round 0
//!   at the pairs it has pending (a sequence resuming after a long pause
//!   pays its catch-up to draft; a fresh sequence's prompt is spread over
//!   the steps it can expect to draft in, see [`catch_up_rows`]) and later
//!   rounds at one row. `F` is not a line: kernels change tiling with the
//!   row count (on a 2-core AMD EPYC an f32 pass of 1–4 rows cost 21–25 ms
//!   and one of 5 rows 31 ms; on a 2-core Xeon, where 1–4 rows take the
//!   tile, 1.05–1.18× a 1-row pass; BENCHMARKS.md, issue 18), so each pass
//!   size keeps its own decayed mean time, as a departure from a decayed
//!   least-squares line `f0 + f1·T` over all sizes (shrunk while the size
//!   has few samples); a size never seen takes the line plus its measured
//!   neighbours' departure, and `F` is made non-decreasing. A pass that
//!   verifies drafts keeps a curve of its own, `V(T)`, never below `F(T)`
//!   (and, from the smallest verifying size measured on, `F` never above
//!   `V`: a lone stream's plain curve knows one size well and took its
//!   slope from a few early passes), and the first draft of a step costs
//!   `V(T + 1) - F(T)`: a verifying pass may cost more than a plain one of
//!   as many tokens, a jump no curve over tokens alone can price. On CUDA
//!   it adds a K/V write launch per layer, and shapes the decode graphs do
//!   not capture run eagerly (before verification passes were captured, the
//!   H200 took 1.8 ms for a plain step of 16 streams and about 4 ms for a
//!   verifying one: BENCHMARKS.md, issue 18). Where the model replays
//!   verifying passes of a few sequences from graphs but runs those of more
//!   eagerly until their shape recurs
//!   ([`CostModel::set_eager_verify_above`]), the two kinds keep separate
//!   `V` curves and a step prices its drafts by its own kind: one curve
//!   over tokens learnt the few-sequence replays' cost and priced a
//!   many-sequence step's drafts at it, where the pass ran eagerly at about
//!   three plain ones (an H100 at 64 streams: 5–58 lookup drafts a run,
//!   0.87–0.96×; priced apart, 2 a run, 0.93–1.00×; BENCHMARKS.md, issue
//!   18, session 39). Until a verification is measured, `F` stands in for
//!   `V` (on the CPU the two nearly coincide), and a batch grants a single
//!   draft, to the sequence likeliest to land it: its pass measures `V` at
//!   the least cost. Verifying costs not measured again for [`SHELF_LIFE`]
//!   decode passes (doubled each time it runs out) are forgotten, and
//!   measured again that way: a sequence that stops drafting because
//!   verification looks dear never revises the figure itself, and one early
//!   verifying pass (the engine's first, with its one-off costs: 5.5 ms
//!   where a plain Q8_0 pass took 3.3 ms and a two-token one 3.9) kept a
//!   lone CPU stream from drafting for good (BENCHMARKS.md, issue 18,
//!   session 29). Round costs and the drafting share of [`catch_up_rows`]
//!   keep such a shelf life too ([`Shelf`]): an engine's first round, with
//!   its one-off costs (5.3 ms for 6 rows where later one-row rounds take
//!   0.3), kept warm engines on the CPU and the H200 from drafting at all
//!   (session 30). Where the rounds measured all fed as many rows, the
//!   fit's split of their time leans towards the rows
//!   ([`PRIOR_ROUND_FIXED_SHARE`]): a one-row round priced too cheap drafts
//!   and is measured; one priced too dear is not. Prompt-lookup drafts cost
//!   no round. Before the first decode pass is measured, priors stand in (a
//!   token a thirty-second of the fixed cost, a round a tenth of a step),
//!   and only a lone decode drafts, at most its `initial_draft`: what
//!   verification costs a batch is unknown until measured (on the H200 a
//!   verifying pass of 16 streams that no graph had captured took 3-5 plain
//!   passes), and a server's first steps, its prompts' chunks beside the
//!   first decodes, are no place to find out.
//! - **Choice**: each drafter a sequence has (the head; prompt lookup when
//!   it proposes) is an offer, and a sequence drafts from one of them.
//!   Starting from no drafts, the policy repeatedly extends the one
//!   offer whose extension (by any number of drafts up to its cap)
//!   brings the most expected tokens per second added, while that rate
//!   beats the step's current tokens per second by a margin (10 %), i.e.
//!   while the extension clearly raises throughput. A cost the whole
//!   batch shares (the jump to a verifying pass, the first round's fixed
//!   part) cannot pay for one sequence's draft when it would for all of
//!   them together, so the choice runs twice: once from the plain step,
//!   once with those costs already paid, and the plan with more expected
//!   tokens per second wins. At a large compute-bound batch the marginal cost of
//!   a draft token nears the cost of a whole decode token, so drafting
//!   turns itself off without a hand-set batch cut; a sequence whose drafts
//!   are rarely accepted stops drafting.
//! - **Probing**: a sequence that does not draft because of its acceptance
//!   (it would with a good one) probes again, with one draft, after a
//!   back-off that doubles with every probe that does not pay, so a useless
//!   drafter costs a vanishing share of the steps. Meanwhile its own head
//!   record fades into the pooled one at every such step: a hard stretch
//!   of text passes, and a record revised only by probes kept sequences
//!   off drafts that pay again (prompt lookup's record, which belongs to
//!   the text being copied, does not fade).
//!
//! `Constant` sequences draft exactly their `initial_draft` (tests and
//! experiments), capped by the plan. No request's tokens depend on any of
//! this (see [`super::spec`]).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use super::ngram::{PromptLookup, Proposal};
use super::spec::Drafting;
use super::{DraftSchedule, SlotId, MAX_DRAFT_TOKENS};

/// Which drafter proposed a sequence's drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Drafter {
    /// The engine's draft head (MTP head or early exit): batched rounds.
    Head,
    /// Prompt lookup: the drafts are known before any round. Its order
    /// (the matched suffix's length) keys the acceptance apart: a
    /// one-token match is copied far less often than a four-token one.
    Lookup(usize),
}

/// Prior acceptance of a drafter nothing has been verified from (and the
/// weight of a sequence's prior in pseudo-observations).
const PRIOR: f64 = 0.5;
const PRIOR_WEIGHT: f64 = 0.5;
/// Acceptance assumed when deciding whether a sequence is worth a probe.
const PROBE_ACCEPTANCE: f64 = 0.9;
/// Weight kept by old observations at each new one.
const FORGET: f64 = 0.95;
/// Weight a sequence's own head record keeps at each step it skips
/// drafting while a good draft would pay: the record fades into the pooled
/// prior. A hard stretch of text (a list, a name) passes, and a record
/// revised only by single-draft probes at doubling intervals kept a lone
/// CPU stream drafting in about half its steps, at 1.06–1.10× where
/// drafting every step ran 1.17× (BENCHMARKS.md, issue 18, session 27).
const IDLE_KEEP: f64 = 0.8;
const MIN_BACKOFF: usize = 8;
const MAX_BACKOFF: usize = 512;

/// Acceptance by draft position for one drafter of one sequence.
#[derive(Debug, Clone)]
struct Acceptance {
    hits: [f64; MAX_DRAFT_TOKENS],
    trials: [f64; MAX_DRAFT_TOKENS],
}

impl Default for Acceptance {
    fn default() -> Self {
        Self {
            hits: [0.0; MAX_DRAFT_TOKENS],
            trials: [0.0; MAX_DRAFT_TOKENS],
        }
    }
}

impl Acceptance {
    /// Position `j`'s acceptance, `prior` standing in for what is not
    /// observed.
    fn rate(&self, j: usize, prior: f64) -> f64 {
        (self.hits[j] + prior * PRIOR_WEIGHT) / (self.trials[j] + PRIOR_WEIGHT)
    }

    /// `reach[j]`: the chance that drafts `0..=j` are all accepted, over
    /// the position priors of `prior` (the head's pooled record) or the
    /// fixed one.
    fn reach(&self, k: usize, prior: Option<&Acceptance>) -> Vec<f64> {
        let mut p = 1.0;
        (0..k.min(MAX_DRAFT_TOKENS))
            .map(|j| {
                p *= self.rate(j, prior.map_or(PRIOR, |a| a.rate(j, PRIOR)));
                p
            })
            .collect()
    }

    /// Every observation so far keeps `keep` of its weight.
    fn fade(&mut self, keep: f64) {
        for j in 0..MAX_DRAFT_TOKENS {
            self.hits[j] *= keep;
            self.trials[j] *= keep;
        }
    }

    fn record(&mut self, drafted: usize, accepted: usize) {
        self.fade(FORGET);
        // Position j was tried when every draft before it was accepted.
        for j in 0..drafted.min(accepted + 1).min(MAX_DRAFT_TOKENS) {
            self.trials[j] += 1.0;
            if j < accepted {
                self.hits[j] += 1.0;
            }
        }
    }
}

/// One sequence's drafting state.
#[derive(Debug, Clone)]
struct SeqState {
    drafting: Drafting,
    acceptance: HashMap<Drafter, Acceptance>,
    /// Steps it skipped drafting for its acceptance, and the skip count
    /// that triggers the next probe.
    idle: usize,
    backoff: usize,
}

/// Decayed least squares `y = a + b·x`.
#[derive(Debug, Clone, Copy, Default)]
struct LinearFit {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

/// Weight kept by old cost samples at each new one.
const COST_FORGET: f64 = 0.98;
/// The least variance of the samples' x for a fitted slope. A single
/// stream's passes are mostly one token with a few drafted ones (x ∈ {1, 2}:
/// variance p(1 - p) < 0.25), and their slope is what decides whether its
/// drafts pay: one drafted pass in twenty-five is enough to measure it.
const MIN_SPREAD: f64 = 0.035;
/// A draft must raise the step's expected tokens per second by this factor
/// at the margin: estimates are noisy, and a marginal gain is not worth
/// the risk of a loss.
const MARGIN: f64 = 1.1;
/// The least a pass token is assumed to cost, as a share of the pass's
/// fixed cost (a noisy fit must never make drafts look free).
const MIN_TOKEN_SHARE: f64 = 0.01;

impl LinearFit {
    fn add(&mut self, x: f64, y: f64) {
        let d = COST_FORGET;
        self.w = self.w * d + 1.0;
        self.x = self.x * d + x;
        self.y = self.y * d + y;
        self.xx = self.xx * d + x * x;
        self.xy = self.xy * d + x * y;
    }

    /// `(a, b)`, with `b` from `slope_prior(a)` while the samples' x do
    /// not vary enough to tell; `None` before any sample.
    fn coefficients(&self, slope_prior: impl Fn(f64) -> f64) -> Option<(f64, f64)> {
        if self.w < 1e-9 {
            return None;
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        let b = if var > MIN_SPREAD {
            ((self.xy / self.w - mx * my) / var).max(0.0)
        } else {
            slope_prior(my / mx.max(1.0))
        };
        Some(((my - b * mx).max(0.0), b))
    }
}

/// Decode passes' time by token count (see the module docs).
#[derive(Debug, Clone, Default)]
struct PassCost {
    line: LinearFit,
    /// Each pass size's samples; their weights decay by [`COST_FORGET`]
    /// per pass recorded, whatever its size.
    sizes: BTreeMap<usize, SizeSamples>,
    /// Passes recorded: the clock the sizes' weights decay by.
    passes: u64,
}

/// One pass size's decayed samples.
#[derive(Debug, Clone, Copy)]
struct SizeSamples {
    weight: f64,
    time: f64,
    /// [`PassCost::passes`] when they were last decayed.
    at: u64,
}

/// What a sample's weight keeps after `passes` more passes.
fn decay(passes: u64) -> f64 {
    COST_FORGET.powi(passes.min(1 << 16) as i32)
}

/// Pseudo-samples of the line in a pass size's estimate: a size measured
/// twice is half its own mean.
const SIZE_SHRINK: f64 = 2.0;

impl PassCost {
    fn add(&mut self, tokens: usize, time: f64) {
        self.line.add(tokens as f64, time);
        self.passes += 1;
        let now = self.passes;
        let s = self.sizes.entry(tokens).or_insert(SizeSamples {
            weight: 0.0,
            time: 0.0,
            at: now,
        });
        let decay = decay(now - s.at);
        s.weight = s.weight * decay + 1.0;
        s.time = s.time * decay + time;
        s.at = now;
    }

    /// `F(t)` for `t` in `0..=max_tokens`: the line `f0 + f1·t` plus each
    /// size's own departure from it (shrunk while it has few samples),
    /// interpolated between the sizes measured and held past them, made
    /// non-decreasing. Interpolating departures rather than falling back
    /// to the line keeps a size just past the measured ones from looking
    /// a step away: a batch measured at 16 tokens whose mean sits below
    /// the line would otherwise see its 17th token cost the gap as well.
    fn curve(&self, f0: f64, f1: f64, max_tokens: usize) -> Vec<f64> {
        let line = |t: usize| f0 + f1 * t as f64;
        let known: Vec<(usize, f64)> = self
            .sizes
            .iter()
            .map(|(&t, s)| {
                let w = s.weight * decay(self.passes - s.at);
                (t, w / (w + SIZE_SHRINK) * (s.time / s.weight - line(t)))
            })
            .collect();
        // `known[next]`: the first measured size at or above `t`.
        let mut next = 0;
        let mut highest = 0.0f64;
        (0..=max_tokens)
            .map(|t| {
                while next < known.len() && known[next].0 < t {
                    next += 1;
                }
                let below = next.checked_sub(1).map(|i| known[i]);
                let departure = match (below, known.get(next)) {
                    (_, Some(&(u, d))) if u == t => d,
                    (Some((a, da)), Some(&(b, db))) => {
                        da + (db - da) * (t - a) as f64 / (b - a) as f64
                    }
                    (Some((_, d)), None) | (None, Some(&(_, d))) => d,
                    (None, None) => 0.0,
                };
                highest = highest.max(line(t) + departure);
                highest
            })
            .collect()
    }
}

/// The step's cost model (see the module docs).
#[derive(Debug, Clone, Default)]
pub(crate) struct CostModel {
    forward: PassCost,
    /// Passes that verified drafts (see the module docs), by
    /// [`CostModel::kind`]: of few sequences, or of more than
    /// `eager_verify_above`.
    verify: [PassCost; 2],
    round: LinearFit,
    /// `verify`'s ages in plain decode passes.
    verify_shelf: [Shelf; 2],
    /// `round`'s age in decode passes.
    round_shelf: Shelf,
    /// Sequences above which verifying passes are priced apart; `None`:
    /// one kind.
    eager_verify_above: Option<usize>,
}

/// Decode steps after which an estimate that only drafting refreshes is
/// forgotten (the first time; doubled each time after, up to 64 times
/// this), so that a stale figure is measured again at the cost of a few
/// drafts in a long run (see the module docs).
pub(crate) const SHELF_LIFE: u64 = 256;

/// The most of decode time that measuring a forgotten estimate again may
/// take: a verifying pass the GPU runs eagerly (10-15 ms where 16 streams
/// replay a plain pass in 1 ms on the H200) measured again every 256
/// passes cost 16- and 64-stream runs 5-10 % (session 30), so such a
/// figure lasts until its excess is a hundredth of the passes' time.
const MEASURE_SHARE: f64 = 0.01;

/// The age of an estimate that only the drafting it discourages
/// refreshes: verifying costs, round costs, the drafting share. Priced too
/// dear once (a first verifying pass or round with its one-off costs),
/// such an estimate stops the drafts that would correct it, for good: a
/// lone CPU stream never drafted for a verifying pass measured once at
/// 5.5 ms (session 29), and on warm engines, CPU and H200 alike, for a
/// first round measured at 5.3 ms where later ones take 0.3 (session 30).
#[derive(Debug, Clone, Copy, Default)]
struct Shelf {
    age: u64,
    /// Times the estimate was forgotten: each doubles its shelf life.
    expiries: u32,
}

impl Shelf {
    fn renew(&mut self) {
        self.age = 0;
    }

    /// One more step without a sample of an estimate that `holds` any;
    /// whether it expires now (and is to be forgotten). It lasts its shelf
    /// life, and at least `patience` steps.
    fn expires(&mut self, holds: bool, patience: u64) -> bool {
        if !holds {
            return false;
        }
        self.age += 1;
        if self.age <= (SHELF_LIFE << self.expiries).max(patience) {
            return false;
        }
        self.age = 0;
        self.expiries = (self.expiries + 1).min(6);
        true
    }
}

/// The costs a step is planned with, in seconds.
#[derive(Debug, Clone)]
struct Costs {
    /// `pass[t]`: a plain decode pass of `t` tokens (every sequence one
    /// token); non-decreasing.
    pass: Vec<f64>,
    /// `verify[t]`: a pass of `t` tokens that verifies drafts,
    /// non-decreasing ([`Costs::verify_time`] keeps it above `pass`);
    /// `None` while none is measured (then `pass` stands in).
    verify: Option<Vec<f64>>,
    /// Per token past `pass`'s end.
    slope: f64,
    /// The least a token adds to a pass (a noisy estimate must never make
    /// drafts look free).
    floor: f64,
    r0: f64,
    r1: f64,
}

/// Until measured, a pass token costs this share of the pass's fixed cost...
const PRIOR_TOKEN_SHARE: f64 = 1.0 / 32.0;
/// ... and a draft round this share of a one-token pass.
const PRIOR_ROUND_SHARE: f64 = 0.1;
/// The share of a round's time taken as fixed while the rounds measured
/// all fed as many rows (so the fit cannot split it): small, since a
/// round priced too cheap drafts and is measured at other sizes, while one
/// priced too dear stops the drafts that would tell (a round 0 catching up
/// 60 pairs in 3 ms, split three to one the other way, priced every later
/// one-row round at 2.3 ms where it takes 0.3 on a 2-core Xeon).
const PRIOR_ROUND_FIXED_SHARE: f64 = 0.25;

impl Costs {
    /// Before any measurement, in units of a step's fixed cost (the choice
    /// depends only on the ratios): `F(t) = 1 + t/32`.
    fn prior() -> Costs {
        Costs {
            pass: vec![1.0],
            verify: None,
            slope: PRIOR_TOKEN_SHARE,
            floor: MIN_TOKEN_SHARE,
            r0: PRIOR_ROUND_SHARE * (1.0 + PRIOR_TOKEN_SHARE),
            r1: 0.0,
        }
    }

    /// `F(t)`.
    fn pass_time(&self, t: usize) -> f64 {
        self.extended(&self.pass, t)
    }

    /// `V(t)`, never below `F(t)`.
    fn verify_time(&self, t: usize) -> f64 {
        match &self.verify {
            Some(verify) => self.extended(verify, t).max(self.pass_time(t)),
            None => self.pass_time(t),
        }
    }

    /// `curve[t]`, continued past its end by the slope.
    fn extended(&self, curve: &[f64], t: usize) -> f64 {
        let last = curve.len() - 1;
        curve[t.min(last)] + self.slope * t.saturating_sub(last) as f64
    }
}

impl CostModel {
    /// Verifying passes of more than `seqs` sequences (when `Some`) are
    /// recorded and priced apart from those of fewer: the model's
    /// [`Model::eager_verify_above`](crate::model::Model::eager_verify_above).
    /// A change forgets the verifying costs measured.
    pub fn set_eager_verify_above(&mut self, seqs: Option<usize>) {
        if seqs != self.eager_verify_above {
            self.eager_verify_above = seqs;
            self.verify = Default::default();
            self.verify_shelf = Default::default();
        }
    }

    /// The verifying record a pass of `seqs` sequences reads and feeds.
    fn kind(&self, seqs: usize) -> usize {
        usize::from(self.eager_verify_above.is_some_and(|few| seqs > few))
    }

    /// A plain decode pass: every sequence fed one token.
    pub fn record_pass(&mut self, tokens: usize, time: Duration) {
        self.forward.add(tokens, time.as_secs_f64());
        for kind in 0..2 {
            let line = &self.verify[kind].line;
            let excess = (line.w > 0.0)
                .then(|| self.mean_pass_at(line.x / line.w))
                .flatten()
                .map(|plain| line.y / line.w - plain);
            let patience = self.patience(excess);
            let holds = self.verify[kind].passes > 0;
            if self.verify_shelf[kind].expires(holds, patience) {
                self.verify[kind] = PassCost::default();
            }
        }
        self.age_round();
    }

    /// A decode pass of `seqs` sequences that verified drafts.
    pub fn record_verify(&mut self, tokens: usize, seqs: usize, time: Duration) {
        let kind = self.kind(seqs);
        self.verify[kind].add(tokens, time.as_secs_f64());
        self.verify_shelf[kind].renew();
        self.age_round();
    }

    /// A draft round that fed the head `rows` rows (pairs) in all.
    pub fn record_round(&mut self, rows: usize, time: Duration) {
        self.round.add(rows as f64, time.as_secs_f64());
        self.round_shelf.renew();
    }

    /// A decode pass went by: round costs not measured again expire.
    fn age_round(&mut self) {
        let patience = self.patience((self.round.w > 0.0).then(|| self.round.y / self.round.w));
        if self.round_shelf.expires(self.round.w > 0.0, patience) {
            self.round = LinearFit::default();
        }
    }

    /// The most tokens of any decode pass measured, plain or verifying.
    fn largest_pass(&self) -> usize {
        let largest = |p: &PassCost| p.sizes.keys().next_back().copied().unwrap_or(0);
        self.verify
            .iter()
            .map(largest)
            .fold(largest(&self.forward), usize::max)
    }

    /// A plain decode pass of `tokens` tokens (the line), if any is measured.
    fn mean_pass_at(&self, tokens: f64) -> Option<f64> {
        let (f0, f1) = self.pass_line()?;
        Some(f0 + f1 * tokens)
    }

    /// The decode passes an estimate must last for measuring it again, at
    /// `excess` seconds over a plain pass, to take at most
    /// [`MEASURE_SHARE`] of their time.
    fn patience(&self, excess: Option<f64>) -> u64 {
        let fit = &self.forward.line;
        match (excess, self.mean_pass_at(fit.x / fit.w)) {
            (Some(excess), Some(plain)) if excess > 0.0 && plain > 0.0 => {
                (excess / (MEASURE_SHARE * plain)).min(1e12) as u64
            }
            _ => 0,
        }
    }

    /// The line `(f0, f1)` through every decode pass measured, its slope
    /// from the prior while the sizes do not vary enough to tell and never
    /// below the least share of a token; `None` before any pass.
    fn pass_line(&self) -> Option<(f64, f64)> {
        let (f0, f1) = self
            .forward
            .line
            .coefficients(|per_token| per_token * PRIOR_TOKEN_SHARE)?;
        Some((f0, f1.max(MIN_TOKEN_SHARE * f0)))
    }

    /// The measured costs for passes of up to `max_tokens` tokens over
    /// `seqs` sequences; `None` before any decode pass is measured (then
    /// [`Costs::prior`]). The priors fill in what the samples cannot tell
    /// yet (a slope, an unmeasured round).
    fn costs(&self, max_tokens: usize, seqs: usize) -> Option<Costs> {
        let measured = &self.verify[self.kind(seqs)];
        let (f0, f1) = self.pass_line()?;
        let (r0, r1) = self
            .round
            .coefficients(|per_row| per_row * (1.0 - PRIOR_ROUND_FIXED_SHARE))
            .unwrap_or((PRIOR_ROUND_SHARE * (f0 + f1), 0.0));
        let mut pass = self.forward.curve(f0, f1, max_tokens);
        let verify = measured
            .line
            .coefficients(|_| f1)
            .map(|(v0, v1)| measured.curve(v0, v1.max(MIN_TOKEN_SHARE * f0), max_tokens));
        // A plain pass of `t` tokens costs no more than a verifying one of
        // as many, so from the smallest verifying size measured on, `V`
        // bounds `F`. A lone stream measures plain passes of one token and
        // verifying ones of 2–4: its plain curve's slope came from a few
        // early two-token passes (on a Xeon, 21.4 ms against 19.6 for a
        // verifying two-token pass later) and priced a 4-token pass at
        // 1.7x a 1-token one where it measured 1.2x (BENCHMARKS.md, issue
        // 18, session 28). The minimum of two non-decreasing curves is one.
        if let (Some(v), Some(from)) = (&verify, measured.sizes.keys().min()) {
            for (f, &v) in pass.iter_mut().zip(v).skip(*from) {
                *f = f.min(v);
            }
        }
        Some(Costs {
            pass,
            verify,
            slope: f1,
            floor: MIN_TOKEN_SHARE * f0,
            r0,
            r1,
        })
    }
}

/// One decoding sequence as the policy sees it this step.
#[derive(Debug, Clone)]
pub(crate) struct Candidate {
    pub slot: SlotId,
    /// Drafts the plan and the sequence's room allow.
    pub cap: usize,
    /// What prompt lookup proposes (empty: nothing, or no lookup).
    pub lookup: Proposal,
    /// Rows the head's round 0 feeds if this sequence drafts from it: the
    /// pairs the head has not consumed (its whole history after a pause).
    pub head_rows: usize,
    /// Whether the head has consumed none of this sequence's pairs: its
    /// round 0 feeds the prompt, once in the sequence's life.
    pub head_fresh: bool,
    /// Tokens the sequence may still write after this step's.
    pub remaining: usize,
}

/// The policy's decision for one candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Grant {
    pub drafts: usize,
    pub drafter: Drafter,
}

/// Every decision about drafts: one store of the slot registry.
#[derive(Debug, Default)]
pub(crate) struct DraftPolicy {
    cost: CostModel,
    seqs: HashMap<SlotId, SeqState>,
    /// Every sequence's verifications of head drafts, decayed alike: the
    /// prior of a sequence's own acceptance of the head.
    pooled_head: Acceptance,
    /// How often sequences past their first round draft: see
    /// [`DraftingShare`].
    drafting_share: DraftingShare,
    /// Drafters the engine has.
    has_head: bool,
    lookup: Option<PromptLookup>,
}

/// The decayed share of decode steps in which a sequence the head has
/// already caught up with drafted: how many of its remaining steps a fresh
/// sequence's catch-up can expect to serve ([`catch_up_rows`]). A lone
/// stream drafts in most of its steps; 16 CPU streams in one in ten or
/// fewer. One pseudo-step that drafted stands in before any is seen.
/// Steps without a caught-up candidate age it ([`Shelf`]): where every
/// sequence is fresh and none drafts, nothing else would revise it.
#[derive(Debug, Clone, Copy, Default)]
struct DraftingShare {
    drafted: f64,
    steps: f64,
    shelf: Shelf,
}

impl DraftingShare {
    fn record(&mut self, drafted: bool) {
        self.drafted = self.drafted * FORGET_SHARE + f64::from(u8::from(drafted));
        self.steps = self.steps * FORGET_SHARE + 1.0;
        self.shelf.renew();
    }

    /// A planned step with no caught-up candidate to record.
    fn unrecorded_step(&mut self) {
        if self.shelf.expires(self.steps > 0.0, 0) {
            (self.drafted, self.steps) = (0.0, 0.0);
        }
    }

    fn share(&self) -> f64 {
        (self.drafted + 1.0) / (self.steps + 1.0)
    }
}

/// Weight kept by older steps in [`DraftingShare`] at each new one.
const FORGET_SHARE: f64 = 0.99;

impl DraftPolicy {
    pub fn new(has_head: bool, lookup: Option<PromptLookup>) -> Self {
        Self {
            has_head,
            lookup,
            ..Self::default()
        }
    }

    pub fn lookup(&self) -> Option<PromptLookup> {
        self.lookup
    }

    pub fn admit(&mut self, slot: SlotId, drafting: Drafting) {
        self.seqs.insert(
            slot,
            SeqState {
                drafting,
                acceptance: HashMap::new(),
                idle: 0,
                backoff: MIN_BACKOFF,
            },
        );
    }

    /// Forgets `slot` (it stops drafting); a no-op for an unknown slot.
    pub fn release(&mut self, slot: SlotId) {
        self.seqs.remove(&slot);
    }

    pub fn drafts(&self, slot: SlotId) -> bool {
        self.seqs.contains_key(&slot)
    }

    /// After a verification of `slot`'s drafts from `drafter`.
    pub fn record(&mut self, slot: SlotId, drafter: Drafter, drafted: usize, accepted: usize) {
        if let Some(s) = self.seqs.get_mut(&slot) {
            s.acceptance
                .entry(drafter)
                .or_default()
                .record(drafted, accepted);
            if drafter == Drafter::Head {
                self.pooled_head.record(drafted, accepted);
            }
        }
    }

    pub fn cost_mut(&mut self) -> &mut CostModel {
        &mut self.cost
    }

    /// Whether any draft could pay in a step of `decodes` drafting sequences
    /// (`slots`) over `base_tokens` pass tokens of `pass_seqs` sequences, each
    /// allowed up to `cap` drafts: some sequence has a constant schedule, or a
    /// perfect run (every draft accepted, no round to pay), by one sequence or
    /// by all of them, would clearly beat the plain step (by the plan's
    /// margin). When not, the engine skips the proposals and the plan: at many
    /// streams their host time is a share of a GPU step (on the H200, 0.6 ms of
    /// a 1.4 ms step at 64; 0.08-0.13 ms after session 26's cheap plans, still
    /// 6-9 %). For the run by all of them, a pass larger than any measured is
    /// priced at no less than the largest measured one's time per token (one
    /// sequence's run stays on the fitted curve: its first draft is how
    /// verification gets measured): extrapolated along the fitted slope, which
    /// a GPU's flat small passes make nearly zero, 64 sequences drafting 8 each
    /// (576 tokens) looked nearly free beside one measured verifying pass of
    /// 65, and every step planned for nothing (BENCHMARKS.md, issue 18, session
    /// 30).
    pub fn worth_planning(
        &self,
        slots: &[SlotId],
        base_tokens: usize,
        cap: usize,
        pass_seqs: usize,
    ) -> bool {
        let constant = slots.iter().any(|s| {
            self.seqs
                .get(s)
                .is_some_and(|s| s.drafting.options.schedule == DraftSchedule::Constant)
        });
        let decodes = slots.len();
        let cap = cap.min(MAX_DRAFT_TOKENS);
        let Some(costs) = self.cost.costs(base_tokens + decodes * cap, pass_seqs) else {
            return constant || lone_decode(decodes, base_tokens);
        };
        let plain = costs.pass_time(base_tokens);
        let rate = decodes as f64 / plain;
        let largest = self.cost.largest_pass().max(1);
        let per_token = costs.pass_time(largest) / largest as f64;
        let bounded = |t: usize| {
            let time = costs.verify_time(t);
            if t > largest {
                time.max(per_token * t as f64)
            } else {
                time
            }
        };
        constant
            || (1..=cap).any(|k| {
                let one = costs.verify_time(base_tokens + k) - plain;
                let all = bounded(base_tokens + decodes * k);
                k as f64 / one.max(costs.floor * k as f64) > MARGIN * rate
                    || (decodes * (1 + k)) as f64 / all > MARGIN * rate
            })
    }

    /// Grants for `candidates` (drafting sequences that decode this step) in
    /// a step whose forward pass carries `base_tokens` tokens of
    /// `pass_seqs` sequences before drafts (the count picks the verifying
    /// kind, [`CostModel::set_eager_verify_above`]).
    pub fn assign(
        &mut self,
        candidates: &[Candidate],
        base_tokens: usize,
        pass_seqs: usize,
    ) -> Vec<Grant> {
        // Each drafter a candidate has is an offer of its own; the plan
        // takes a candidate's drafts from at most one of them.
        let mut options = Vec::new();
        let mut owner = Vec::new();
        for (i, c) in candidates.iter().enumerate() {
            for o in self.offers(c) {
                options.push(o);
                owner.push(i);
            }
        }
        let mut drafts = vec![0usize; options.len()];
        // Nothing measured yet: the priors decide for a lone decode, up to
        // its initial draft; nobody else drafts (see the module docs).
        let most_tokens = base_tokens + options.iter().map(|o| o.reach.len()).sum::<usize>();
        let (costs, cold) = match self.cost.costs(most_tokens, pass_seqs) {
            Some(costs) => (costs, false),
            None => (Costs::prior(), true),
        };
        // A probe is the candidate's first offer's.
        let probing: Vec<bool> = (0..options.len())
            .map(|e| options[e].probe_due && (e == 0 || owner[e - 1] != owner[e]))
            .collect();
        let lone = lone_decode(candidates.len(), base_tokens);
        let mut reach: Vec<Vec<f64>> = options
            .iter()
            .zip(&probing)
            .map(|(o, &p)| {
                if cold && !lone {
                    Vec::new()
                } else if p {
                    // One draft tells whether the first position pays; a
                    // longer probe of a drafter that does not pay would
                    // cost a round per draft.
                    optimistic(o.reach.len().min(1))
                } else if cold {
                    o.reach[..o.initial.min(o.reach.len())].to_vec()
                } else {
                    o.reach.clone()
                }
            })
            .collect();
        if !cold && costs.verify.is_none() && !lone {
            measure_verification_first(&mut reach);
        }
        let mut plan = StepModel::new(costs.clone(), base_tokens, candidates.len());
        plan.fill(&reach, &options, &owner, &mut drafts);
        let head_round = options
            .iter()
            .zip(&reach)
            .any(|(o, r)| o.drafter == Drafter::Head && !r.is_empty());
        // Priors are guesses: only measured costs are worth sharing. Filling
        // a plan is quadratic in its grants, and with the shared costs paid
        // every draft looks good against the step's lowered rate (at 64
        // streams on the H200, 0.3-0.7 ms of a 1.4 ms step for a plan then
        // thrown away): fill it only when it could win.
        if !cold {
            let mut shared = StepModel::new(costs, base_tokens, candidates.len())
                .with_shared_costs_paid(head_round);
            if shared.best_rate(&reach, &options) > plan.rate() {
                let mut shared_drafts = vec![0usize; options.len()];
                shared.fill(&reach, &options, &owner, &mut shared_drafts);
                if shared.rate() > plan.rate() {
                    (plan, drafts) = (shared, shared_drafts);
                }
            }
        }
        tracing::debug!(
            base_tokens,
            cold,
            pass_ms = ?(base_tokens..base_tokens + 4)
                .map(|t| (plan.costs.pass_time(t) * 1e4).round() / 10.0)
                .collect::<Vec<_>>(),
            verify_ms = ?(base_tokens + 1..base_tokens + 4)
                .map(|t| (plan.costs.verify_time(t) * 1e4).round() / 10.0)
                .collect::<Vec<_>>(),
            slope_ms = plan.costs.slope * 1e3,
            round_ms = ?(plan.costs.r0 * 1e3, plan.costs.r1 * 1e3),
            drafting_share = self.drafting_share.share(),
            drafts = drafts.iter().sum::<usize>(),
            "draft plan: pass time from the step's tokens on"
        );
        // Each candidate's offer: the one granted drafts, else its first.
        let mut chosen: Vec<usize> = Vec::with_capacity(candidates.len());
        for (e, &i) in owner.iter().enumerate() {
            if chosen.len() == i {
                chosen.push(e);
            } else if drafts[e] > 0 {
                chosen[i] = e;
            }
        }
        let options: Vec<&Choice> = chosen.iter().map(|&e| &options[e]).collect();
        let mut drafts: Vec<usize> = chosen.iter().map(|&e| drafts[e]).collect();
        let probing: Vec<bool> = chosen.iter().map(|&e| probing[e]).collect();
        self.update_probes(candidates, &options, &drafts, &plan, &probing);
        let mut recorded = false;
        for (c, &d) in candidates.iter().zip(&drafts) {
            if !c.head_fresh && self.seqs.contains_key(&c.slot) {
                self.drafting_share.record(d > 0);
                recorded = true;
            }
        }
        if !recorded {
            self.drafting_share.unrecorded_step();
        }
        for (d, o) in drafts.iter_mut().zip(&options) {
            if let Some(k) = o.constant {
                *d = k;
            }
        }
        drafts
            .into_iter()
            .zip(options)
            .map(|(drafts, o)| Grant {
                drafts,
                drafter: o.drafter,
            })
            .collect()
    }

    /// What a candidate's drafters offer: the longer expected run first
    /// (prompt lookup on a tie: it costs no round), the other after it. A
    /// drafter that does not pay at its run's length may pay at another's
    /// price: on the H200, head and lookup together drafted 2 tokens where
    /// lookup alone drafted 346 and ran 1.20x (the head's longer expected
    /// run won the choice, and its rounds did not pay; BENCHMARKS.md, issue
    /// 18, session 30). A constant schedule drafts from the first only.
    fn offers(&self, c: &Candidate) -> Vec<Choice> {
        let Some(s) = self.seqs.get(&c.slot) else {
            return vec![Choice::none()];
        };
        let opts = s.drafting.options;
        let cap = c.cap.min(opts.max_draft);
        let reach_of = |d: Drafter, k: usize| {
            let prior = (d == Drafter::Head).then_some(&self.pooled_head);
            s.acceptance.get(&d).map_or_else(
                || Acceptance::default().reach(k, prior),
                |a| a.reach(k, prior),
            )
        };
        let by_lookup = Drafter::Lookup(c.lookup.order);
        let mut runs: Vec<(Drafter, Vec<f64>)> = Vec::new();
        if !c.lookup.tokens.is_empty() {
            runs.push((
                by_lookup,
                reach_of(by_lookup, c.lookup.tokens.len().min(cap)),
            ));
        }
        if self.has_head {
            runs.push((Drafter::Head, reach_of(Drafter::Head, cap)));
        }
        let expected = |r: &[f64]| r.iter().sum::<f64>();
        // Stable: lookup, pushed first, stays first on a tie.
        runs.sort_by(|a, b| expected(&b.1).total_cmp(&expected(&a.1)));
        let constant = opts.schedule == DraftSchedule::Constant;
        if constant {
            runs.truncate(1);
        }
        if runs.is_empty() {
            runs.push((Drafter::Head, Vec::new()));
        }
        runs.into_iter()
            .map(|(drafter, reach)| Choice {
                drafter,
                initial: opts.initial_draft,
                constant: constant.then(|| opts.initial_draft.min(reach.len())),
                probe_due: s.idle >= s.backoff,
                head_rows: catch_up_rows(c, &reach, self.drafting_share.share()),
                reach,
            })
            .collect()
    }

    /// Advances the probe clocks: a sequence left without drafts that an
    /// accepted draft would have paid for waits towards a probe; a probe
    /// that did not earn drafts doubles the wait; drafting resets it.
    fn update_probes(
        &mut self,
        candidates: &[Candidate],
        options: &[&Choice],
        drafts: &[usize],
        plan: &StepModel,
        probing: &[bool],
    ) {
        for (i, c) in candidates.iter().enumerate() {
            let Some(s) = self.seqs.get_mut(&c.slot) else {
                continue;
            };
            if options[i].reach.is_empty() {
                continue;
            }
            if probing[i] {
                s.idle = 0;
                s.backoff = (2 * s.backoff).min(MAX_BACKOFF);
            } else if drafts[i] > 0 {
                s.idle = 0;
                s.backoff = MIN_BACKOFF;
            } else if plan.would_pay(options[i], PROBE_ACCEPTANCE) {
                s.idle += 1;
                // Only the head's record has a pooled one to fade into.
                if let (Drafter::Head, Some(a)) =
                    (options[i].drafter, s.acceptance.get_mut(&Drafter::Head))
                {
                    a.fade(IDLE_KEEP);
                }
            }
        }
    }
}

/// What one candidate offers the step.
#[derive(Debug, Clone)]
struct Choice {
    drafter: Drafter,
    initial: usize,
    /// A constant schedule's length (overrides the model).
    constant: Option<usize>,
    probe_due: bool,
    /// `reach[j]`: chance that drafts `0..=j` are accepted; its length is
    /// the most drafts this candidate may take.
    reach: Vec<f64>,
    /// The rows round 0 is priced at: [`catch_up_rows`].
    head_rows: f64,
}

impl Choice {
    fn none() -> Self {
        Self {
            drafter: Drafter::Head,
            initial: 0,
            constant: None,
            probe_due: false,
            reach: Vec::new(),
            head_rows: 1.0,
        }
    }
}

/// The rows a candidate's round 0 is priced at: all the pairs the head has
/// not consumed, but for a fresh sequence, whose prompt's pairs are fed
/// once in its life and serve every later round: the pairs a drafting
/// step of `reach` leaves (the tokens it yields), and the rest spread over
/// the steps the sequence can expect to draft in (its remaining tokens
/// over the tokens such a step yields, times the share of steps in which
/// caught-up sequences draft lately; near its end, or where sequences
/// rarely draft, it pays nearly all).
/// Charged to one step, a fresh sequence's prompt (50-150 pairs, about
/// 2 ms of head on a 2-core Xeon) outweighed what a draft earns in a
/// 3.3 ms Q8_0 step, and a lone Q8_0 stream never drafted (BENCHMARKS.md,
/// issue 18, session 29). A sequence that resumes drafting after a pause
/// pays its catch-up in full: it pauses again whenever drafts stop paying,
/// so that catch-up recurs. Spread over every remaining token, catch-ups
/// let 16 CPU streams draft more often and lose (0.90-0.97x against
/// 0.95-0.99x).
fn catch_up_rows(c: &Candidate, reach: &[f64], drafting_share: f64) -> f64 {
    let rows = c.head_rows.max(1) as f64;
    if !c.head_fresh {
        return rows;
    }
    // Pairs a drafting step leaves the head: what recurs every step.
    let per_step = 1.0 + reach.iter().sum::<f64>();
    let steady = rows.min(per_step);
    let steps = (drafting_share * c.remaining as f64 / per_step).max(1.0);
    steady + (rows - steady) / steps
}

/// Whether a step is one decode and nothing else: the one shape that
/// drafts on priors (see the module docs).
fn lone_decode(decodes: usize, base_tokens: usize) -> bool {
    decodes == 1 && base_tokens == 1
}

/// Leaves one draft to the candidate likeliest to land it, and none to
/// the rest: a batch's first verifying pass measures `V` at the least
/// cost, since it may cost several plain passes (an uncaptured shape on a
/// GPU).
fn measure_verification_first(reach: &mut [Vec<f64>]) {
    let best = (0..reach.len())
        .filter(|&i| !reach[i].is_empty())
        .max_by(|&a, &b| reach[a][0].total_cmp(&reach[b][0]));
    for (i, r) in reach.iter_mut().enumerate() {
        r.truncate(usize::from(Some(i) == best));
    }
}

fn optimistic(k: usize) -> Vec<f64> {
    let mut p = 1.0;
    (0..k)
        .map(|_| {
            p *= PROBE_ACCEPTANCE;
            p
        })
        .collect()
}

/// The step being planned: its expected tokens and time so far.
struct StepModel {
    costs: Costs,
    /// The pass's tokens, drafts granted so far included.
    pass_tokens: usize,
    /// Whether the pass is priced as verifying (`V`): from the start when
    /// the shared costs are paid up front, else once a draft joins it.
    verifies: bool,
    tokens: f64,
    time: f64,
    /// Members of head round `r`.
    round_members: Vec<usize>,
}

impl StepModel {
    /// The plain step of `decodes` sequences and `base_tokens` pass
    /// tokens, before drafts.
    fn new(costs: Costs, base_tokens: usize, decodes: usize) -> Self {
        Self {
            time: costs.pass_time(base_tokens),
            costs,
            pass_tokens: base_tokens,
            verifies: false,
            tokens: decodes as f64,
            round_members: vec![0; MAX_DRAFT_TOKENS],
        }
    }

    /// The same step with the costs drafts share paid up front: the jump
    /// to a verifying pass and, when `head_round`, the first head round's
    /// fixed part.
    fn with_shared_costs_paid(mut self, head_round: bool) -> Self {
        self.time = self.costs.verify_time(self.pass_tokens);
        self.verifies = true;
        if head_round {
            // A phantom member opens round 0; it drafts nothing.
            self.round_members[0] = 1;
            self.time += self.costs.r0;
        }
        self
    }

    /// Expected tokens per second.
    fn rate(&self) -> f64 {
        self.tokens / self.time.max(1e-12)
    }

    /// A bound on the rate any filling of this step reaches: each draft
    /// priced at the least it can add (the pass's floor per token and, from
    /// the head, a member's share of a round), the drafts taken best gain
    /// per time first while they raise the rate (which maximises a ratio
    /// of sums; the real plan also pays round and pass jumps and takes a
    /// sequence's drafts in order, so it can only do worse).
    fn best_rate(&self, reach: &[Vec<f64>], options: &[Choice]) -> f64 {
        let mut drafts: Vec<(f64, f64)> = reach
            .iter()
            .zip(options)
            .flat_map(|(r, o)| {
                let round = match o.drafter {
                    Drafter::Head => self.costs.r1,
                    Drafter::Lookup(_) => 0.0,
                };
                let least = self.costs.floor + round;
                r.iter().map(move |&gain| (gain, least))
            })
            .collect();
        drafts.sort_by(|a, b| (b.0 * a.1).total_cmp(&(a.0 * b.1)));
        let (mut tokens, mut time) = (self.tokens, self.time.max(1e-12));
        for (gain, least) in drafts {
            if gain * time <= tokens * least {
                break;
            }
            tokens += gain;
            time += least;
        }
        tokens / time
    }

    /// The time of head round `r` for one more member `o` (its rows, and
    /// the fixed part when it opens the round); nothing for prompt lookup.
    fn round_time(&self, o: &Choice, r: usize) -> f64 {
        match o.drafter {
            Drafter::Lookup(_) => 0.0,
            Drafter::Head => {
                let rows = if r == 0 { o.head_rows } else { 1.0 };
                let opens = self.round_members[r] == 0;
                self.costs.r1 * rows + if opens { self.costs.r0 } else { 0.0 }
            }
        }
    }

    /// The pass's time as planned so far.
    fn pass_now(&self) -> f64 {
        if self.verifies {
            self.costs.verify_time(self.pass_tokens)
        } else {
            self.costs.pass_time(self.pass_tokens)
        }
    }

    /// What `added` more draft tokens add to a pass of time `now`.
    fn pass_added(&self, now: f64, added: usize) -> f64 {
        let pass = self.costs.verify_time(self.pass_tokens + added) - now;
        pass.max(self.costs.floor * added as f64)
    }

    /// Time added by drafts `from..to` of one sequence `o`.
    fn added_time(&self, o: &Choice, from: usize, to: usize) -> f64 {
        let rounds: f64 = (from..to).map(|r| self.round_time(o, r)).sum();
        rounds + self.pass_added(self.pass_now(), to - from)
    }

    /// Whether one draft of `o` accepted with probability `p` raises the
    /// rate.
    fn would_pay(&self, o: &Choice, p: f64) -> bool {
        let dt = self.added_time(o, 0, 1);
        dt > 0.0 && p / dt > MARGIN * self.rate()
    }

    /// The greedy choice of the module docs, over offers (`options`, with
    /// `reach`), `owner[e]` the candidate of offer `e`: a candidate's
    /// drafts come from one offer.
    fn fill(
        &mut self,
        reach: &[Vec<f64>],
        options: &[Choice],
        owner: &[usize],
        drafts: &mut [usize],
    ) {
        // `taken[c]`: the offer candidate `c` drafts from, once it does.
        let mut taken: Vec<Option<usize>> = vec![None; owner.last().map_or(0, |&c| c + 1)];
        loop {
            let now = self.pass_now();
            let mut best: Option<(f64, usize, usize, f64, f64)> = None;
            for (i, r) in reach.iter().enumerate() {
                if taken[owner[i]].is_some_and(|e| e != i) {
                    continue;
                }
                let from = drafts[i];
                let (mut gain, mut rounds) = (0.0, 0.0);
                for to in from + 1..=r.len() {
                    gain += r[to - 1];
                    rounds += self.round_time(&options[i], to - 1);
                    let dt = rounds + self.pass_added(now, to - from);
                    let rate = gain / dt.max(1e-12);
                    if best.is_none_or(|b| rate > b.0) {
                        best = Some((rate, i, to, gain, dt));
                    }
                }
            }
            let Some((rate, i, to, gain, dt)) = best else {
                return;
            };
            if rate <= MARGIN * self.rate() {
                return;
            }
            if options[i].drafter == Drafter::Head {
                for r in drafts[i]..to {
                    self.round_members[r] += 1;
                }
            }
            self.pass_tokens += to - drafts[i];
            self.verifies = true;
            drafts[i] = to;
            taken[owner[i]] = Some(i);
            self.tokens += gain;
            self.time += dt;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::SpecOptions;

    fn drafting(schedule: DraftSchedule) -> Drafting {
        Drafting {
            options: SpecOptions {
                enabled: true,
                initial_draft: 2,
                max_draft: 6,
                schedule,
            },
        }
    }

    fn candidate(slot: SlotId, cap: usize) -> Candidate {
        Candidate {
            slot,
            cap,
            lookup: Proposal::default(),
            head_rows: 1,
            head_fresh: false,
            remaining: 64,
        }
    }

    /// Slot `slot` with room for 6 drafts and prompt lookup proposing
    /// `tokens` from a match of `order` tokens.
    fn lookup_candidate(slot: SlotId, order: usize, tokens: Vec<u32>) -> Candidate {
        Candidate {
            slot,
            cap: 6,
            lookup: Proposal { order, tokens },
            head_rows: 1,
            head_fresh: false,
            remaining: 64,
        }
    }

    /// A CPU-like cost: a step of T tokens costs 10 ms + 1 ms · T, whether
    /// it verifies or not, a round 0.5 ms + 0.1 ms per member.
    fn measured(policy: &mut DraftPolicy) {
        for t in [1, 2, 4, 8, 16, 64] {
            let time = Duration::from_micros(10_000 + 1_000 * t as u64);
            policy.cost_mut().record_pass(t, time);
            policy
                .cost_mut()
                .record_verify(t + 1, t, time + Duration::from_millis(1));
        }
        for m in [1, 2, 4, 8] {
            policy
                .cost_mut()
                .record_round(m, Duration::from_micros(500 + 100 * m as u64));
        }
    }

    /// A lone stream's rounds on a GPU: one to three rows at about 170 µs,
    /// and every twentieth round 0 a catch-up of 150 pending pairs (the
    /// stream resumed drafting) at 3 ms. A round of one row is still
    /// priced near 170 µs: the catch-ups teach the per-row cost.
    #[test]
    fn a_catch_up_round_prices_its_rows_not_every_round() {
        let mut cost = CostModel::default();
        cost.record_pass(1, Duration::from_micros(800));
        for i in 0..60u64 {
            if i % 20 == 19 {
                cost.record_round(150, Duration::from_millis(3));
            } else {
                let rows = 1 + i % 3;
                cost.record_round(rows as usize, Duration::from_micros(165 + 5 * rows));
            }
        }
        let c = cost.costs(8, 1).unwrap();
        let one_row = c.r0 + c.r1;
        assert!((one_row - 170e-6).abs() < 30e-6, "one row: {one_row:e} s");
        assert!(
            c.r0 + 150.0 * c.r1 > 2e-3,
            "a catch-up: {:e} s",
            c.r0 + 150.0 * c.r1
        );
    }

    /// A lone stream whose drafts pay when the head is current does not
    /// draft when its round 0 must first feed the head 300 pending pairs
    /// (0.1 ms a row on CPU-like costs: 30 ms against an 11 ms step).
    #[test]
    fn a_catch_up_is_priced_over_the_steps_it_serves() {
        let mut policy = one_sequence(Drafter::Head, 4, 3);
        let current = policy.assign(&[candidate(1, 6)], 1, 1);
        assert!(current[0].drafts > 0, "{current:?}");
        // 300 pairs at 0.1 ms: 30 ms against an 11 ms step.
        let behind = |head_fresh, remaining| Candidate {
            head_rows: 300,
            head_fresh,
            remaining,
            ..candidate(1, 6)
        };
        let mut drafts = |c| policy.assign(&[c], 1, 1)[0].drafts;
        assert_eq!(drafts(behind(true, 2)), 0, "a prompt near its end");
        assert!(
            drafts(behind(true, 4_000)) > 0,
            "a prompt, thousands of tokens to go"
        );
        assert_eq!(drafts(behind(false, 4_000)), 0, "a resumed sequence");
    }

    /// Where caught-up sequences rarely draft, a prompt's catch-up serves
    /// few rounds: it is charged nearly in full.
    #[test]
    fn a_prompt_catch_up_is_spread_over_the_steps_sequences_draft() {
        let mut policy = one_sequence(Drafter::Head, 4, 3);
        let prompt = Candidate {
            head_rows: 300,
            head_fresh: true,
            remaining: 40,
            ..candidate(1, 6)
        };
        assert!(policy.assign(std::slice::from_ref(&prompt), 1, 1)[0].drafts > 0);
        // A caught-up sequence that stopped drafting (a useless stretch;
        // it probes now and then).
        policy.admit(2, drafting(DraftSchedule::Adaptive));
        for _ in 0..50 {
            policy.record(2, Drafter::Head, 1, 0);
        }
        for _ in 0..400 {
            policy.assign(&[candidate(2, 6)], 1, 1);
        }
        // Fresh sequences alone record nothing: the share ages, and is
        // forgotten after its shelf life.
        for step in 0..=SHELF_LIFE {
            let grant = policy.assign(std::slice::from_ref(&prompt), 1, 1);
            assert_eq!(grant[0].drafts, 0, "step {step}");
        }
        assert!(policy.assign(&[prompt], 1, 1)[0].drafts > 0);
    }

    /// A verifying pass measured far dearer than a plain one (a GPU's
    /// eager pass among replayed ones: 15 ms against 1 ms) is measured
    /// again only as rarely as keeps that a hundredth of the time.
    #[test]
    fn a_dear_measurement_is_repeated_rarely() {
        let mut cost = CostModel::default();
        let plain = |cost: &mut CostModel, n: usize| {
            for _ in 0..n {
                cost.record_pass(16, Duration::from_millis(1));
            }
        };
        plain(&mut cost, 100);
        cost.record_verify(17, 16, Duration::from_millis(15));
        plain(&mut cost, 1_100);
        assert!(cost.verify[0].passes > 0, "kept past the shelf life");
        plain(&mut cost, 400);
        assert_eq!(cost.verify[0].passes, 0, "forgotten at about 14 ms / 1 %");
    }

    /// Rounds measured at one size only (catch-ups of 60 pairs, 3 ms each)
    /// cannot split fixed from per-row time: a one-row round is priced at
    /// the cheap end, where drafting measures it.
    #[test]
    fn rounds_of_one_size_price_a_one_row_round_cheap() {
        let mut cost = CostModel::default();
        cost.record_pass(1, Duration::from_micros(3_300));
        for _ in 0..10 {
            cost.record_round(60, Duration::from_millis(3));
        }
        let c = cost.costs(8, 1).unwrap();
        assert!(c.r0 + c.r1 < 1e-3, "one row: {:e} s", c.r0 + c.r1);
        assert!((c.r0 + 60.0 * c.r1 - 3e-3).abs() < 1e-6, "60 rows");
    }

    /// A lone stream whose drafts pay stops drafting when its rounds are
    /// measured dear (a first round's one-off costs), and drafts again
    /// once that figure has gone a shelf life unrevised.
    #[test]
    fn round_costs_not_measured_again_are_forgotten() {
        let mut policy = one_sequence(Drafter::Head, 4, 3);
        let drafts = |policy: &mut DraftPolicy| policy.assign(&[candidate(1, 6)], 1, 1)[0].drafts;
        assert!(drafts(&mut policy) > 0);
        for rows in [1, 6].repeat(100) {
            policy
                .cost_mut()
                .record_round(rows, Duration::from_millis(20));
        }
        for _ in 0..SHELF_LIFE {
            policy.cost_mut().record_pass(1, Duration::from_millis(11));
        }
        assert_eq!(drafts(&mut policy), 0, "20 ms a round does not pay");
        policy.cost_mut().record_pass(1, Duration::from_millis(11));
        assert!(drafts(&mut policy) > 0, "forgotten after its shelf life");
    }

    /// Rounds that cost three steps: the head's long expected run does not
    /// pay, and prompt lookup's shorter one, which needs no round, drafts.
    #[test]
    fn a_drafter_whose_run_does_not_pay_leaves_the_other_to_draft() {
        let mut policy = DraftPolicy::new(true, Some(PromptLookup::default()));
        measured(&mut policy);
        for rows in [1, 2, 4].repeat(100) {
            policy
                .cost_mut()
                .record_round(rows, Duration::from_millis(30));
        }
        admit_with_records(&mut policy, (6, 6), 2, (2, 2));
        let c = lookup_candidate(1, 2, vec![5, 6]);
        let g = &policy.assign(std::slice::from_ref(&c), 1, 1)[0];
        assert_eq!((g.drafts, g.drafter), (2, Drafter::Lookup(2)), "{g:?}");
        // With cheap rounds the head's longer run wins.
        for rows in [1, 2, 4].repeat(200) {
            policy
                .cost_mut()
                .record_round(rows, Duration::from_micros(100));
        }
        let g = policy.assign(&[c], 1, 1);
        assert_eq!(g[0].drafter, Drafter::Head, "{g:?}");
        assert!(g[0].drafts > 2, "{g:?}");
    }

    /// The bound that decides whether a plan is worth filling is one: no
    /// filling beats it, over batches of head and lookup drafts with
    /// varied acceptance, from the plain step and with the shared costs
    /// paid, on CPU-like costs and on graph-like ones (where a draft costs
    /// little more than the bound's least).
    #[test]
    fn no_filled_plan_beats_its_bound() {
        let mut cpu = DraftPolicy::new(true, None);
        measured(&mut cpu);
        for policy in [cpu, graph_like().0] {
            assert_plans_within_bound(&policy);
        }
    }

    fn assert_plans_within_bound(policy: &DraftPolicy) {
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as f64 / (1u64 << 31) as f64
        };
        for trial in 0..200 {
            let n = 1 + trial % 17;
            let options: Vec<Choice> = (0..n)
                .map(|i| {
                    let mut p = 1.0;
                    let first = next();
                    let reach = (0..1 + (i + trial) % 8)
                        .map(|_| {
                            p *= first.max(next());
                            p
                        })
                        .collect();
                    Choice {
                        drafter: if i % 3 == 0 {
                            Drafter::Lookup(2)
                        } else {
                            Drafter::Head
                        },
                        reach,
                        ..Choice::none()
                    }
                })
                .collect();
            let reach: Vec<Vec<f64>> = options.iter().map(|o| o.reach.clone()).collect();
            let costs = policy.cost.costs(64 + 8 * n, 64).unwrap();
            for shared in [false, true] {
                let mut plan = StepModel::new(costs.clone(), n + trial % 5, n);
                if shared {
                    plan = plan.with_shared_costs_paid(true);
                }
                let bound = plan.best_rate(&reach, &options);
                let mut drafts = vec![0; n];
                let owner: Vec<usize> = (0..n).collect();
                plan.fill(&reach, &options, &owner, &mut drafts);
                assert!(
                    plan.rate() <= bound * (1.0 + 1e-9),
                    "trial {trial}: {} > {bound}",
                    plan.rate()
                );
            }
        }
    }

    #[test]
    fn acceptance_counts_only_the_positions_tried() {
        let mut a = Acceptance::default();
        a.record(4, 1); // positions 0 (hit) and 1 (miss) tried; 2, 3 not reached
        assert!(a.rate(0, PRIOR) > PRIOR && a.rate(1, PRIOR) < PRIOR);
        assert_eq!(a.rate(2, PRIOR), PRIOR);
        a.record(2, 2); // positions 0 and 1 tried and hit; the old counts decay
        assert!((a.trials[1] - (FORGET + 1.0)).abs() < 1e-12);
        assert!((a.hits[1] - 1.0).abs() < 1e-12);
        assert_eq!(a.trials[2], 0.0, "position 2 was never reached");
    }

    #[test]
    fn the_fit_recovers_a_line_and_falls_back_to_the_prior_slope() {
        let mut f = LinearFit::default();
        assert!(f.coefficients(|_| 0.0).is_none());
        f.add(4.0, 0.5);
        let (a, b) = f.coefficients(|per| per / 32.0).unwrap();
        assert!((a + 4.0 * b - 0.5).abs() < 1e-9, "through the one point");
        for x in 0..20 {
            f.add(x as f64, 2.0 + 0.25 * x as f64);
        }
        let (a, b) = f.coefficients(|_| 99.0).unwrap();
        assert!((b - 0.25).abs() < 0.05 && (a - 2.0).abs() < 0.3, "{a} {b}");
    }

    #[test]
    fn a_single_streams_few_drafted_passes_measure_the_slope() {
        // Nine one-token passes of 10 ms to one two-token pass of 13 ms: the
        // second token's 3 ms is measured, not the prior's thirty-second of
        // a step.
        let mut f = LinearFit::default();
        for i in 0..200 {
            match i % 10 {
                0 => f.add(2.0, 0.013),
                _ => f.add(1.0, 0.010),
            }
        }
        let (a, b) = f.coefficients(|per| per / 32.0).unwrap();
        assert!(
            (b - 0.003).abs() < 1e-4 && (a - 0.007).abs() < 1e-4,
            "{a} {b}"
        );
    }

    /// A cost model that measured `passes` (tokens, milliseconds) `times`
    /// times over, in turn.
    fn measured_passes(passes: &[(usize, f64)], times: usize) -> CostModel {
        let mut model = CostModel::default();
        for _ in 0..times {
            for &(t, ms) in passes {
                model.record_pass(t, Duration::from_secs_f64(ms / 1e3));
            }
        }
        model
    }

    /// Passes of 1–9 tokens shaped like SmolLM2 f32 on a 2-core AVX-512
    /// host: 1–4 rows on a few-rows path (20 ms + 0.2 ms a row), 5 and
    /// more on the tiles (30 ms + 0.2 ms a row); or without that step.
    fn pass_cost(step: bool) -> CostModel {
        let passes: Vec<(usize, f64)> = (1..=9)
            .map(|t| (t, if step && t >= 5 { 30.0 } else { 20.0 } + 0.2 * t as f64))
            .collect();
        measured_passes(&passes, 10)
    }

    #[test]
    fn each_pass_size_keeps_its_own_cost() {
        let model = pass_cost(true);
        let f = model.costs(12, 1).unwrap();
        assert!(f.pass.windows(2).all(|w| w[1] >= w[0]), "{:?}", f.pass);
        let ms = |t: usize| f.pass_time(t) * 1e3;
        // Shrunk towards the line a little, but the step stays a step.
        assert!(ms(2) - ms(1) < 1.0, "{} {}", ms(1), ms(2));
        assert!(ms(5) - ms(4) > 6.0, "{} {}", ms(4), ms(5));
        assert!((ms(4) - 20.8).abs() < 2.0 && (ms(9) - 31.8).abs() < 2.0);
        // Past the sizes measured, the line's slope.
        assert!((f.pass_time(20) - f.pass_time(12) - 8.0 * f.slope).abs() < 1e-9);
        // A size not seen for long returns to the line.
        let mut later = model.clone();
        for _ in 0..400 {
            later.record_pass(1, Duration::from_micros(20_300));
        }
        let (f0, f1) = later.pass_line().unwrap();
        let at5 = later.costs(5, 1).unwrap().pass[5];
        assert!((at5 - (f0 + 5.0 * f1)).abs() < 1e-4, "{at5} vs the line");
    }

    #[test]
    fn measured_verifying_passes_bound_the_plain_curve() {
        // A lone stream: plain passes of one token, two early plain passes
        // of two (slow: before the kernels settled), then verifying passes
        // of 2 and 3 tokens (the Xeon's trace, ms).
        let mut model = measured_passes(&[(1, 17.7)], 40);
        for _ in 0..2 {
            model.record_pass(2, Duration::from_micros(21_400));
        }
        for _ in 0..30 {
            model.record_verify(2, 1, Duration::from_micros(19_600));
            model.record_verify(3, 1, Duration::from_micros(20_800));
        }
        let f = model.costs(8, 1).unwrap();
        let ms = |t: usize| f.verify_time(t) * 1e3;
        assert!((ms(2) - 19.6).abs() < 0.5, "V(2) = {}", ms(2));
        assert!((ms(3) - 20.8).abs() < 0.5, "V(3) = {}", ms(3));
        assert!(
            ms(4) < 23.0,
            "V(4) = {}: the verifying line, not the plain one",
            ms(4)
        );
        assert!(f.pass_time(3) <= f.verify_time(3) + 1e-12);
        assert!(
            (f.pass_time(1) * 1e3 - 17.7).abs() < 0.5,
            "below the verifying sizes F stays"
        );
        assert!(f.pass.windows(2).all(|w| w[1] >= w[0]), "{:?}", f.pass);
    }

    #[test]
    fn a_size_next_to_the_measured_ones_costs_the_slope() {
        // 16 streams: passes of 16 tokens, and a tail of smaller ones that
        // cost more per token (a concave cost), no pass of 17 yet.
        let passes = [
            (16, 40.0),
            (16, 40.0),
            (16, 40.0),
            (12, 36.0),
            (8, 28.0),
            (4, 16.0),
            (1, 7.0),
        ];
        let model = measured_passes(&passes, 20);
        let (f0, f1) = model.pass_line().unwrap();
        assert!(f0 + 16.0 * f1 > 0.041, "the mean at 16 sits below the line");
        let f = model.costs(20, 1).unwrap();
        let extra = f.pass_time(17) - f.pass_time(16);
        assert!(
            (extra - f.slope).abs() < 1e-9,
            "{extra} against the slope {}",
            f.slope
        );
    }

    #[test]
    fn drafts_stop_before_a_pass_size_that_costs_a_step() {
        // Lookup drafts accepted 0.8 of the time each.
        let reach: Vec<f64> = (1..=6).map(|j| 0.8f64.powi(j)).collect();
        let options = [Choice {
            drafter: Drafter::Lookup(3),
            reach: reach.clone(),
            ..Choice::none()
        }];
        let grant = |costs: Costs| {
            let mut drafts = [0];
            StepModel::new(costs, 1, 1).fill(
                std::slice::from_ref(&reach),
                &options,
                &[0],
                &mut drafts,
            );
            drafts[0]
        };
        let stepped = pass_cost(true);
        assert_eq!(
            grant(stepped.costs(7, 1).unwrap()),
            3,
            "4 rows, not the 5-row step"
        );
        assert_eq!(
            grant(pass_cost(false).costs(7, 1).unwrap()),
            6,
            "no step: the cap"
        );
        // The line through the same samples spreads the step over every
        // token and would draft into it.
        let line = Costs {
            pass: vec![stepped.pass_line().unwrap().0],
            ..stepped.costs(0, 1).unwrap()
        };
        assert!(grant(line) > 4);
    }

    #[test]
    fn a_perfect_drafter_drafts_the_maximum_and_a_useless_one_stops() {
        let mut policy = two_head_sequences();
        for _ in 0..20 {
            policy.record(1, Drafter::Head, 6, 6);
            policy.record(2, Drafter::Head, 6, 0);
        }
        let grants = policy.assign(&[candidate(1, 6), candidate(2, 6)], 2, 2);
        assert_eq!(grants[0].drafts, 6, "perfect acceptance drafts the cap");
        assert_eq!(grants[1].drafts, 0, "a useless drafter does not draft");
    }

    #[test]
    fn a_large_compute_bound_batch_turns_drafting_off() {
        let mut policy = DraftPolicy::new(true, None);
        // Each token costs as much as the fixed part: compute-bound.
        for t in [1, 8, 32, 64] {
            policy
                .cost_mut()
                .record_pass(t, Duration::from_micros(1_000 + 1_000 * t as u64));
        }
        let slots = first_drafts_land(&mut policy, 64);
        let grants = policy.assign(&slots, 64, slots.len());
        assert!(grants.iter().all(|g| g.drafts == 0), "{grants:?}");
        // One sequence alone on a latency-bound step drafts.
        let grants = policy.assign(&slots[..1], 1, 1);
        assert!(grants[0].drafts > 0);
    }

    /// `n` adaptive sequences whose head drafts two, of which the first
    /// lands and the second does not (75 % acceptance); their candidates.
    fn first_drafts_land(policy: &mut DraftPolicy, n: SlotId) -> Vec<Candidate> {
        for s in 0..n {
            policy.admit(s, drafting(DraftSchedule::Adaptive));
            for _ in 0..10 {
                policy.record(s, Drafter::Head, 2, 1);
            }
        }
        (0..n).map(|s| candidate(s, 6)).collect()
    }

    /// CUDA-like: a plain pass replays a graph (1 ms, nearly flat), a
    /// round costs 20 µs and 2 µs a member; 16 sequences whose first draft
    /// is nearly always accepted and second nearly never.
    fn graph_like() -> (DraftPolicy, Vec<Candidate>) {
        let mut policy = DraftPolicy::new(true, None);
        for t in [1, 4, 16] {
            policy
                .cost_mut()
                .record_pass(t, Duration::from_micros(1_000 + 10 * t as u64));
        }
        for m in [1, 4, 16] {
            policy
                .cost_mut()
                .record_round(m, Duration::from_micros(20 + 2 * m as u64));
        }
        let slots = first_drafts_land(&mut policy, 16);
        (policy, slots)
    }

    /// Verifying passes of `sizes` tokens, each `fixed_us` µs and 10 µs a
    /// token.
    fn verifying_passes(policy: &mut DraftPolicy, sizes: &[usize], fixed_us: u64) {
        for &t in sizes {
            policy
                .cost_mut()
                .record_verify(t, 16, Duration::from_micros(fixed_us + 10 * t as u64));
        }
    }

    #[test]
    fn a_verifying_pass_that_runs_eagerly_prices_the_first_draft() {
        // Verifying passes run eagerly: 3 ms.
        let (mut policy, slots) = graph_like();
        let unmeasured = policy.assign(&slots, 16, slots.len());
        let drafts: Vec<usize> = unmeasured.iter().map(|g| g.drafts).collect();
        assert_eq!(
            drafts.iter().sum::<usize>(),
            1,
            "no verification measured: one draft measures it, {drafts:?}"
        );
        verifying_passes(&mut policy, &[17, 24, 40], 3_000);
        let grants = policy.assign(&slots, 16, slots.len());
        assert!(grants.iter().all(|g| g.drafts == 0), "{grants:?}");
        // A perfect drafter on a lone stream still pays for the jump: seven
        // tokens for about 3.7 ms against one for 1 ms.
        policy.admit(99, drafting(DraftSchedule::Adaptive));
        for _ in 0..20 {
            policy.record(99, Drafter::Head, 6, 6);
        }
        assert_eq!(policy.assign(&[candidate(99, 6)], 1, 1)[0].drafts, 6);
    }

    /// Where few sequences' verifying passes replay graphs (1 ms and 10 µs
    /// a token, like a plain pass) and 16 sequences' run eagerly (3 ms),
    /// the 16-sequence step prices its drafts by its own kind: one draft
    /// to measure it, then none; few sequences still draft at replay cost,
    /// unless the pass holds more sequences than draft.
    /// With one curve for both, the replays' cost at 17–36 tokens priced
    /// the 16-sequence step's drafts as nearly free.
    #[test]
    fn verifying_passes_of_many_sequences_are_priced_apart_where_few_replay() {
        let replays = |policy: &mut DraftPolicy| {
            for (t, seqs) in [(2, 1), (5, 2), (12, 3), (20, 4), (36, 4)] {
                let time = Duration::from_micros(1_000 + 10 * t as u64);
                policy.cost_mut().record_verify(t, seqs, time);
            }
        };
        let drafted = |grants: &[Grant]| grants.iter().map(|g| g.drafts).sum::<usize>();
        // One record for every pass: the replays price the big step's drafts.
        let (mut single, slots) = graph_like();
        replays(&mut single);
        assert!(drafted(&single.assign(&slots, 16, slots.len())) > 1);
        let (mut split, slots) = graph_like();
        split.cost_mut().set_eager_verify_above(Some(4));
        replays(&mut split);
        assert_eq!(
            drafted(&split.assign(&slots, 16, slots.len())),
            1,
            "measures its kind first"
        );
        verifying_passes(&mut split, &[17], 3_000);
        assert_eq!(drafted(&split.assign(&slots, 16, slots.len())), 0);
        assert!(
            drafted(&split.assign(&slots[..3], 3, 3)) > 0,
            "few still replay"
        );
        // Three drafting sequences beside two that do not: the pass's five
        // run eagerly, and are priced so.
        assert_eq!(drafted(&split.assign(&slots[..3], 5, 5)), 0);
    }

    /// A lone Q8_0-like stream: plain passes 3.3 ms, a draft round 0.3 ms,
    /// half of its first drafts accepted, and one verifying pass of two
    /// tokens measured at 5.5 ms (a cold first one) where it costs 3.6.
    #[test]
    fn verifying_costs_not_measured_again_are_forgotten() {
        let mut policy = DraftPolicy::new(true, None);
        policy.admit(1, drafting(DraftSchedule::Adaptive));
        for accepted in [1, 0].repeat(10) {
            policy.record(1, Drafter::Head, 1, accepted);
        }
        policy
            .cost_mut()
            .record_round(1, Duration::from_micros(300));
        let plain = |policy: &mut DraftPolicy, n: u64| {
            for _ in 0..n {
                policy
                    .cost_mut()
                    .record_pass(1, Duration::from_micros(3_300));
            }
        };
        let drafts = |policy: &mut DraftPolicy| policy.assign(&[candidate(1, 6)], 1, 1)[0].drafts;
        plain(&mut policy, 20);
        assert!(
            drafts(&mut policy) > 0,
            "unmeasured: the plain curve prices it"
        );
        verifying_passes(&mut policy, &[2], 5_480);
        plain(&mut policy, SHELF_LIFE);
        assert_eq!(
            drafts(&mut policy),
            0,
            "2.2 ms for half a token does not pay"
        );
        plain(&mut policy, 1);
        assert!(drafts(&mut policy) > 0, "forgotten after its shelf life");
        // Measured again, as dear: the next shelf life is twice as long.
        verifying_passes(&mut policy, &[2], 5_480);
        plain(&mut policy, 2 * SHELF_LIFE);
        assert_eq!(drafts(&mut policy), 0);
        plain(&mut policy, 1);
        assert!(drafts(&mut policy) > 0);
        // Measured at what it costs, a draft pays.
        verifying_passes(&mut policy, &[2], 3_580);
        assert!(drafts(&mut policy) > 0);
    }

    #[test]
    fn a_jump_that_pays_only_when_shared_is_taken_by_the_whole_batch() {
        // Verifying passes cost 0.3 ms more than plain ones: no one
        // sequence's draft pays for that, sixteen together do.
        let (mut policy, slots) = graph_like();
        verifying_passes(&mut policy, &[17, 24, 32], 1_300);
        let grants = policy.assign(&slots, 16, slots.len());
        assert!(grants.iter().all(|g| g.drafts >= 1), "{grants:?}");
        // One draft at a time, from the plain step, none pays it.
        let costs = policy.cost.costs(64, 1).unwrap();
        let options: Vec<Choice> = slots.iter().map(|c| policy.offers(c).remove(0)).collect();
        let reach: Vec<Vec<f64>> = options.iter().map(|o| o.reach.clone()).collect();
        let mut drafts = vec![0; slots.len()];
        let owner: Vec<usize> = (0..slots.len()).collect();
        StepModel::new(costs, 16, 16).fill(&reach, &options, &owner, &mut drafts);
        assert_eq!(drafts, vec![0; 16]);
    }

    #[test]
    fn planning_is_skipped_only_where_no_draft_could_pay() {
        let (mut policy, slots) = graph_like();
        let ids: Vec<SlotId> = slots.iter().map(|c| c.slot).collect();
        assert!(
            policy.worth_planning(&ids, 16, 6, ids.len()),
            "verification unmeasured"
        );
        verifying_passes(&mut policy, &[17, 24], 1_000);
        assert!(
            policy.worth_planning(&ids, 16, 6, ids.len()),
            "verification as cheap as a pass"
        );
        let mut policy = graph_like().0;
        // Verifying passes at 20 ms against plain ones of 1 ms: no run,
        // however perfect, pays.
        verifying_passes(&mut policy, &[17, 24, 32, 64, 112], 20_000);
        assert!(!policy.worth_planning(&ids, 16, 6, ids.len()));
        assert!(policy
            .assign(&slots, 16, slots.len())
            .iter()
            .all(|g| g.drafts == 0));
        // A constant schedule drafts whatever it costs.
        policy.admit(99, drafting(DraftSchedule::Constant));
        assert!(policy.worth_planning(&[99], 1, 6, 1));
        // Cheap verification: worth planning again.
        let (mut cheap, _) = graph_like();
        verifying_passes(&mut cheap, &[17, 24, 32], 1_100);
        assert!(cheap.worth_planning(&ids, 16, 6, ids.len()));
        // 64 streams, plain passes flat at 1.4 ms, one verifying pass of 65
        // measured at 7.3 ms (eager): 576 tokens are no cheaper a token
        // than 65, and no perfect run of any length pays.
        let mut wide = DraftPolicy::new(true, None);
        for t in [61, 62, 63, 64] {
            wide.cost_mut()
                .record_pass(t, Duration::from_micros(1_390 + t as u64 / 8));
        }
        wide.cost_mut()
            .record_verify(65, 64, Duration::from_micros(7_300));
        let many: Vec<SlotId> = (0..64).collect();
        assert!(!wide.worth_planning(&many, 64, 8, many.len()));
        // Before any measurement only a lone decode plans.
        let fresh = DraftPolicy::new(true, None);
        assert!(fresh.worth_planning(&[1], 1, 6, 1));
        assert!(!fresh.worth_planning(&[1, 2], 2, 6, 2));
    }

    #[test]
    fn before_any_measurement_a_lone_stream_drafts_and_a_busy_batch_does_not() {
        let mut policy = DraftPolicy::new(true, None);
        let slots: Vec<Candidate> = (0..64).map(|s| candidate(s, 6)).collect();
        for s in 0..64 {
            policy.admit(s, drafting(DraftSchedule::Adaptive));
        }
        let one = policy.assign(&slots[..1], 1, 1);
        assert!(
            (1..=2).contains(&one[0].drafts),
            "a lone stream drafts, at most its initial 2: {one:?}"
        );
        // 64 decodes beside 448 prompt tokens, or 16 alone: a batch waits
        // for measured costs.
        let many = policy.assign(&slots, 512, slots.len());
        assert!(many.iter().all(|g| g.drafts == 0), "{many:?}");
        let batch = policy.assign(&slots[..16], 16, 16);
        assert!(batch.iter().all(|g| g.drafts == 0), "{batch:?}");
        // A lone decode beside a prompt chunk waits too.
        assert_eq!(policy.assign(&slots[..1], 100, 1)[0].drafts, 0);
    }

    #[test]
    fn a_useless_drafter_probes_with_a_doubling_back_off() {
        let mut policy = one_sequence(Drafter::Head, 2, 0);
        let mut probes = Vec::new();
        for step in 0..200 {
            let g = policy.assign(&[candidate(1, 6)], 1, 1);
            if g[0].drafts > 0 {
                assert_eq!(g[0].drafts, 1, "step {step}: a probe drafts once");
                probes.push(step);
                policy.record(1, Drafter::Head, g[0].drafts, 0);
            }
        }
        assert!(probes.len() >= 2 && probes.len() <= 5, "{probes:?}");
        let gaps: Vec<usize> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.windows(2).all(|g| g[1] > g[0]), "{gaps:?}");
    }

    /// A sequence whose drafts failed for a stretch, while the head kept
    /// paying for the others, drafts again once the stretch has passed:
    /// its record fades into the pooled one while it waits, rather than
    /// waiting on single-draft probes to outvote it.
    #[test]
    fn a_bad_stretch_fades_into_the_pooled_record() {
        let mut policy = two_head_sequences();
        for _ in 0..20 {
            policy.record(2, Drafter::Head, 2, 0);
        }
        for _ in 0..40 {
            policy.record(1, Drafter::Head, 2, 2);
        }
        assert_eq!(policy.assign(&[candidate(2, 6)], 1, 1)[0].drafts, 0);
        // From here on sequence 2's drafts are accepted again.
        let resumed = (1..200).find(|_| {
            let drafts = policy.assign(&[candidate(2, 6)], 1, 1)[0].drafts;
            if drafts > 0 {
                policy.record(2, Drafter::Head, drafts, drafts);
            }
            drafts > 1
        });
        assert!(
            resumed.is_some_and(|step| step <= 2 * MIN_BACKOFF),
            "drafted more than a probe's one draft at step {resumed:?}"
        );
    }

    /// A measured policy with a head and adaptive sequences 1 and 2.
    fn two_head_sequences() -> DraftPolicy {
        let mut policy = DraftPolicy::new(true, None);
        measured(&mut policy);
        policy.admit(1, drafting(DraftSchedule::Adaptive));
        policy.admit(2, drafting(DraftSchedule::Adaptive));
        policy
    }

    /// A measured policy with only `drafter`'s kind, in which sequence 1
    /// (adaptive) had it verify `drafted` drafts twenty times, accepting
    /// `accepted`.
    fn one_sequence(drafter: Drafter, drafted: usize, accepted: usize) -> DraftPolicy {
        let lookup = matches!(drafter, Drafter::Lookup(_));
        let mut policy = DraftPolicy::new(!lookup, lookup.then(PromptLookup::default));
        measured(&mut policy);
        policy.admit(1, drafting(DraftSchedule::Adaptive));
        for _ in 0..20 {
            policy.record(1, drafter, drafted, accepted);
        }
        policy
    }

    /// Admits slot 1 with 20 verifications of `(drafted, accepted)` from
    /// the head and from prompt lookup of order `order`.
    fn admit_with_records(
        policy: &mut DraftPolicy,
        head: (usize, usize),
        order: usize,
        lookup: (usize, usize),
    ) {
        policy.admit(1, drafting(DraftSchedule::Adaptive));
        for _ in 0..20 {
            policy.record(1, Drafter::Head, head.0, head.1);
            policy.record(1, Drafter::Lookup(order), lookup.0, lookup.1);
        }
    }

    /// [`one_sequence`], after which sequence 1 left and sequence 2
    /// arrived.
    fn after_one_sequence(drafter: Drafter, drafted: usize, accepted: usize) -> DraftPolicy {
        let mut policy = one_sequence(drafter, drafted, accepted);
        policy.release(1);
        policy.admit(2, drafting(DraftSchedule::Adaptive));
        policy
    }

    #[test]
    fn a_new_sequence_starts_from_what_its_drafter_did_for_earlier_ones() {
        // A head that never paid: a fresh sequence waits for a probe
        // instead of drafting at once.
        let mut policy = after_one_sequence(Drafter::Head, 2, 0);
        let first_draft = (0..40).find(|_| policy.assign(&[candidate(2, 6)], 1, 1)[0].drafts > 0);
        assert_eq!(first_draft, Some(MIN_BACKOFF), "the first draft is a probe");
        // A head that always paid: a fresh sequence drafts the cap.
        let mut policy = after_one_sequence(Drafter::Head, 6, 6);
        assert_eq!(policy.assign(&[candidate(2, 6)], 1, 1)[0].drafts, 6);
        // Prompt lookup's record stays with the text it copied: a fresh
        // sequence's match starts from the fixed prior.
        let mut policy = after_one_sequence(Drafter::Lookup(3), 4, 0);
        let c = lookup_candidate(2, 3, vec![5, 6, 7, 8]);
        assert!(policy.assign(&[c], 1, 1)[0].drafts > 0);
    }

    #[test]
    fn constant_schedules_and_caps_win() {
        let mut policy = DraftPolicy::new(true, None);
        measured(&mut policy);
        policy.admit(1, drafting(DraftSchedule::Constant));
        for _ in 0..20 {
            policy.record(1, Drafter::Head, 2, 0);
        }
        let g = policy.assign(&[candidate(1, 6), candidate(9, 6)], 1, 2);
        assert_eq!(g[0].drafts, 2, "constant ignores acceptance and cost");
        assert_eq!(g[1].drafts, 0, "unknown slots never draft");
        assert_eq!(
            policy.assign(&[candidate(1, 1)], 1, 1)[0].drafts,
            1,
            "the cap"
        );
        policy.release(1);
        assert_eq!(policy.assign(&[candidate(1, 6)], 1, 1)[0].drafts, 0);
    }

    #[test]
    fn prompt_lookup_is_chosen_when_it_offers_the_longer_run() {
        let mut policy = DraftPolicy::new(true, Some(PromptLookup::default()));
        measured(&mut policy);
        admit_with_records(&mut policy, (4, 0), 3, (4, 4));
        let c = lookup_candidate(1, 3, vec![5, 6, 7, 8]);
        let g = policy.assign(std::slice::from_ref(&c), 1, 1);
        assert_eq!(
            g[0],
            Grant {
                drafts: 4,
                drafter: Drafter::Lookup(3)
            }
        );
        // Without a proposal the head is the only drafter.
        let g = policy.assign(&[candidate(1, 6)], 1, 1);
        assert_eq!(g[0].drafter, Drafter::Head);
    }

    #[test]
    fn prompt_lookup_orders_keep_their_own_acceptance() {
        let mut policy = DraftPolicy::new(false, Some(PromptLookup::default()));
        measured(&mut policy);
        policy.admit(1, drafting(DraftSchedule::Adaptive));
        for _ in 0..20 {
            policy.record(1, Drafter::Lookup(4), 6, 6);
            policy.record(1, Drafter::Lookup(1), 6, 0);
        }
        let proposal = |order| lookup_candidate(1, order, vec![5; 6]);
        let long = policy.assign(&[proposal(4)], 1, 1);
        assert_eq!(
            long[0].drafts, 6,
            "a four-token match that pays drafts the cap"
        );
        let short = policy.assign(&[proposal(1)], 1, 1);
        assert_eq!(
            short[0].drafts, 0,
            "a one-token match that never pays does not draft"
        );
        // An order never verified starts from the prior, not from another's.
        let fresh = policy.assign(&[proposal(2)], 1, 1);
        assert!(fresh[0].drafts > 0, "{fresh:?}");
    }
}
