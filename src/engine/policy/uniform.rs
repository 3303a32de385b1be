//! Drafts in shapes a GPU replays. A device that captures decode passes in
//! CUDA graphs replays a plain pass of many sequences, but a verifying pass
//! only once its shape (rows, sequences) is captured, and most totals of
//! drafts a free plan makes at many sequences never recur: each ran
//! eagerly at about three plain passes, so prompt lookup's few drafts at 16
//! streams cost more than they earned (0.92-0.96x on the H100), and the
//! head, priced by those eager passes, never drafted there (BENCHMARKS.md,
//! issue 18, sessions 35-38). So, where [`GraphShapes`] says graphs
//! replay and a decode-only step has more than `few_seqs` sequences, a
//! step's drafts total `k` per sequence, `k` a power of two
//! ([`GraphShapes::uniform`]), spread over the sequences by the chance of
//! each draft landing, or there are none. Those shapes are captured at
//! their first run and recur, so the verifying costs the policy learns are
//! a replay's. The model offers its shapes only with
//! `TANDEM_UNIFORM_DRAFTS=1` until the rule is measured on a GPU.

use super::{Choice, StepModel, MARGIN, MAX_DRAFT_TOKENS};
use crate::model::GraphShapes;

/// Whether a step of `base_tokens` pass tokens over `pass_seqs` sequences
/// must draft in uniform totals: decode only (a pass with a prompt chunk
/// runs eagerly anyway), more than a few sequences, and room in a graph
/// for one draft each.
pub(super) fn applies(shapes: Option<GraphShapes>, base_tokens: usize, pass_seqs: usize) -> bool {
    shapes.is_some_and(|s| {
        base_tokens == pass_seqs && pass_seqs > s.few_seqs && 2 * pass_seqs <= s.max_rows
    })
}

/// The plan a step takes under the uniform rule: of `free` (the policy's
/// own plan, drafts per offer) if its total is uniform, and of each
/// uniform total that beats the plain step by the plan's margin, the one
/// with the most expected tokens per second; no drafts if there is none.
/// `owner[e]` is offer `e`'s candidate, `reach[e]` what it may draft.
pub(super) fn plan(
    shapes: GraphShapes,
    empty: &StepModel,
    free: (StepModel, Vec<usize>),
    reach: &[Vec<f64>],
    options: &[Choice],
    owner: &[usize],
) -> (StepModel, Vec<usize>) {
    let seqs = empty.pass_tokens;
    let offer = chosen_offers(&free.1, reach, owner);
    let total: usize = free.1.iter().sum();
    let mut best = if shapes.uniform(seqs + total, seqs) {
        free
    } else {
        (empty.clone(), vec![0; reach.len()])
    };
    let mut entries: Vec<(f64, usize, usize)> = offer
        .iter()
        .flatten()
        .flat_map(|&e| reach[e].iter().enumerate().map(move |(j, &p)| (p, e, j)))
        .collect();
    // Best chance first; a sequence's earlier draft before its later one
    // on a tie, so the drafts taken are each offer's first ones.
    entries.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.2.cmp(&b.2)));
    let plain = empty.rate();
    for k in (0..=MAX_DRAFT_TOKENS.ilog2()).map(|b| 1usize << b) {
        let drafts = k * seqs;
        if drafts > entries.len() || !shapes.uniform(seqs + drafts, seqs) {
            break;
        }
        let mut counts = vec![0usize; reach.len()];
        for &(_, e, _) in &entries[..drafts] {
            counts[e] += 1;
        }
        let mut step = empty.clone();
        for (e, &n) in counts.iter().enumerate().filter(|(_, &n)| n > 0) {
            step.grant(&options[e], &reach[e], 0, n);
        }
        if step.rate() > MARGIN * plain && step.rate() > best.0.rate() {
            best = (step, counts);
        }
    }
    best
}

/// Each candidate's offer for a uniform plan: the one `drafts` grants, else
/// its first with any reach (the longer expected run); `None` for a
/// candidate with nothing to draft.
fn chosen_offers(drafts: &[usize], reach: &[Vec<f64>], owner: &[usize]) -> Vec<Option<usize>> {
    let mut offer: Vec<Option<usize>> = vec![None; owner.last().map_or(0, |&c| c + 1)];
    for (e, &c) in owner.iter().enumerate() {
        let first = offer[c].is_none() && !reach[e].is_empty();
        if drafts[e] > 0 || first {
            offer[c] = Some(e);
        }
    }
    offer
}
