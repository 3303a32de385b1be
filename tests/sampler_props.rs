//! Property tests (a batched call equals each slot sampled alone; the
//! uniform path equals the serial path) and a chi-square test of the
//! sampled frequencies against the truncated softmax.

use candle_core::{Device, Tensor};
use proptest::prelude::*;
use tandem::sampler::{SamplePath, SampleResult, Sampler, SamplingOptions};

fn tensor(rows: &[Vec<f32>], v: usize) -> Tensor {
    Tensor::from_vec(rows.concat(), (rows.len(), v), &Device::Cpu).unwrap()
}

fn options() -> impl Strategy<Value = SamplingOptions> {
    (
        (
            prop::sample::select(vec![0.0f32, 0.7, 1.3]),
            prop::sample::select(vec![0i32, 1, 3]),
            prop::sample::select(vec![1.0f32, 0.5, 0.9]),
            prop::sample::select(vec![0.0f32, 0.1]),
        ),
        (
            prop::sample::select(vec![1.0f32, 1.5]),
            prop::sample::select(vec![0.0f32, 0.5]),
            prop::sample::select(vec![0.0f32, 0.3]),
            prop::sample::select(vec![0i32, 2, 4, -1]),
        ),
        (any::<bool>(), 0usize..4, any::<u64>()),
    )
        .prop_map(
            |((t, k, p, mp), (rp, pp, fp, n), (lp, top, seed))| SamplingOptions {
                temperature: t,
                top_k: k,
                top_p: p,
                min_p: mp,
                repeat_penalty: rp,
                presence_penalty: pp,
                frequency_penalty: fp,
                repeat_last_n: n,
                logprobs: lp,
                top_logprobs: top,
                seed: Some(seed),
            },
        )
}

#[derive(Debug, Clone)]
struct Case {
    vocab: usize,
    slots: Vec<(u32, SamplingOptions, Vec<u32>)>,
    /// Per step: the slot indices named (in call order) and their rows.
    steps: Vec<(Vec<usize>, Vec<Vec<f32>>)>,
}

fn case(shared: bool) -> impl Strategy<Value = Case> {
    (3usize..20, 1usize..5)
        .prop_flat_map(move |(vocab, n)| {
            let slot = (options(), prop::collection::vec(0..vocab as u32, 0..8));
            let step = prop::sample::subsequence((0..n).collect::<Vec<_>>(), 1..=n)
                .prop_shuffle()
                .prop_flat_map(move |order| {
                    // Half-steps make ties common (equal logits).
                    let row = prop::collection::vec((-8i32..8).prop_map(|x| x as f32 * 0.5), vocab);
                    let rows = prop::collection::vec(row, order.len());
                    (Just(order), rows)
                });
            (
                Just(vocab),
                prop::collection::vec(slot, n),
                prop::collection::vec(step, 1..4),
                prop::collection::btree_set(any::<u32>(), n),
            )
        })
        .prop_map(move |(vocab, mut slots, steps, ids)| {
            if shared {
                let first = slots[0].0;
                for (i, s) in slots.iter_mut().enumerate() {
                    s.0 = SamplingOptions {
                        seed: Some(i as u64 * 7 + 1),
                        ..first
                    };
                }
            }
            let slots = ids
                .into_iter()
                .zip(slots)
                .map(|(id, (o, p))| (id, o, p))
                .collect();
            Case {
                vocab,
                slots,
                steps,
            }
        })
}

/// What a request keeps of its row.
fn kept(
    res: &SampleResult,
    row: usize,
    o: &SamplingOptions,
) -> (u32, Option<f32>, Vec<(u32, f32)>) {
    let (lp, top) = res.for_row(row, o);
    (res.tokens[row], lp, top)
}

fn check_batched_equals_alone(c: &Case) -> Result<(), TestCaseError> {
    let mut batched = Sampler::with_seed(32, 1);
    let mut alone: Vec<Sampler> = Vec::new();
    for (id, o, p) in &c.slots {
        batched.add(*id, *o, p).unwrap();
        let mut s = Sampler::with_seed(32, 2);
        s.add(*id, *o, p).unwrap();
        alone.push(s);
    }
    for (order, rows) in &c.steps {
        let ids: Vec<u32> = order.iter().map(|&i| c.slots[i].0).collect();
        let res = batched.sample(&ids, &tensor(rows, c.vocab)).unwrap();
        for (row, &i) in order.iter().enumerate() {
            let (id, o, _) = &c.slots[i];
            let one = alone[i]
                .sample(&[*id], &tensor(std::slice::from_ref(&rows[row]), c.vocab))
                .unwrap();
            prop_assert_eq!(
                kept(&res, row, o),
                kept(&one, 0, o),
                "slot {} row {}",
                id,
                row
            );
        }
    }
    for (id, _, _) in &c.slots {
        let i = c.slots.iter().position(|s| s.0 == *id).unwrap();
        prop_assert_eq!(batched.history(*id), alone[i].history(*id));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn batched_call_equals_each_slot_alone(c in case(false)) {
        check_batched_equals_alone(&c)?;
    }

    #[test]
    fn batched_call_equals_each_slot_alone_with_shared_options(c in case(true)) {
        check_batched_equals_alone(&c)?;
    }

    /// Identical options, full rings, every slot in registration order:
    /// the uniform path and the forced serial path agree on everything.
    #[test]
    fn uniform_path_equals_serial_path(c in case(true)) {
        // num_ctx = window, so repeat_last_n = -1 is a window of 4 too.
        let window = 4;
        let mk = || {
            let mut s = Sampler::with_seed(window, 3);
            for (id, o, p) in &c.slots {
                let mut priors = p.clone();
                priors.resize(priors.len().max(window), 0);
                s.add(*id, *o, &priors).unwrap();
            }
            s
        };
        let (mut uni, mut ser) = (mk(), mk());
        let ids: Vec<u32> = c.slots.iter().map(|s| s.0).collect();
        for (_, rows) in &c.steps {
            // One row per registered slot, in registration order.
            let rows: Vec<Vec<f32>> = (0..ids.len()).map(|i| rows[i % rows.len()].clone()).collect();
            let t = tensor(&rows, c.vocab);
            let a = uni.sample(&ids, &t).unwrap();
            let b = ser.sample_serial_for_bench(&ids, &t).unwrap();
            prop_assert_eq!(a.path, SamplePath::Uniform);
            prop_assert_eq!(b.path, SamplePath::Serial);
            prop_assert_eq!(&a.tokens, &b.tokens);
            prop_assert_eq!(&a.logprobs, &b.logprobs);
            prop_assert_eq!(&a.top_logprobs, &b.top_logprobs);
        }
        for id in &ids {
            prop_assert_eq!(uni.history(*id), ser.history(*id));
        }
    }
}

/// Pearson's chi-square of observed counts against expected probabilities.
fn chi_square(counts: &[u64], expected: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(expected)
        .map(|(&o, &p)| {
            let e = p * n as f64;
            if e == 0.0 {
                if o == 0 {
                    0.0
                } else {
                    f64::INFINITY
                }
            } else {
                (o as f64 - e).powi(2) / e
            }
        })
        .sum()
}

/// The truncated, tempered softmax worked out independently of the
/// sampler, in f64 and with a full sort.
fn expected(logits: &[f32], t: f64, top_k: usize, top_p: f64, min_p: f64) -> Vec<f64> {
    let x: Vec<f64> = logits.iter().map(|&v| f64::from(v)).collect();
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = x.iter().map(|v| (v - m).exp()).sum();
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap().then(a.cmp(&b)));
    let mut keep = vec![false; x.len()];
    let mut cum = 0.0;
    for (pos, &i) in order.iter().enumerate() {
        if pos >= top_k || cum >= top_p {
            break;
        }
        keep[i] = true;
        cum += (x[i] - m).exp() / z;
    }
    for i in 0..x.len() {
        keep[i] &= x[i] >= m + min_p.ln();
    }
    let w: Vec<f64> = (0..x.len())
        .map(|i| if keep[i] { ((x[i] - m) / t).exp() } else { 0.0 })
        .collect();
    let s: f64 = w.iter().sum();
    w.iter().map(|v| v / s).collect()
}

/// Draws `50 × 800` tokens from `logits` under the given options (50
/// seeded slots on the uniform path) and returns the counts per token.
fn draw_counts(logits: &[f32], t: f32, top_k: usize, top_p: f32, min_p: f32) -> Vec<u64> {
    let v = logits.len();
    let slots = 50u32;
    let mut s = Sampler::with_seed(16, 1);
    for id in 0..slots {
        let o = SamplingOptions {
            temperature: t,
            top_k: top_k as i32,
            top_p,
            min_p,
            seed: Some(1000 + u64::from(id)),
            ..SamplingOptions::default()
        };
        s.add(id, o, &[]).unwrap();
    }
    let ids: Vec<u32> = (0..slots).collect();
    let rows: Vec<Vec<f32>> = (0..slots).map(|_| logits.to_vec()).collect();
    let batch = tensor(&rows, v);
    let mut counts = vec![0u64; v];
    for _ in 0..800 {
        let res = s.sample(&ids, &batch).unwrap();
        assert_eq!(res.path, SamplePath::Uniform);
        for tok in res.tokens {
            counts[tok as usize] += 1;
        }
    }
    counts
}

/// 0.1% critical values of chi-square for 1..=7 degrees of freedom.
const CHI2_CRIT: [f64; 7] = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32];

fn assert_fits(counts: &[u64], want: &[f64], wrongs: &[(&str, Vec<f64>)]) {
    let support = want.iter().filter(|&&p| p > 0.0).count();
    let crit = CHI2_CRIT[support - 2];
    let chi = chi_square(counts, want);
    assert!(
        chi < crit,
        "chi-square {chi} >= {crit}: counts {counts:?} vs {want:?}"
    );
    // The same counts reject what a wrong implementation would produce.
    for (name, wrong) in wrongs {
        let chi = chi_square(counts, wrong);
        assert!(chi > crit, "{name} was not rejected (chi-square {chi})");
    }
}

// Probabilities in shuffled id order (rank != id).
const PROBS: [f64; 8] = [0.12, 0.03, 0.30, 0.06, 0.15, 0.10, 0.04, 0.20];

// Top-k, top-p and min-p all cut a suffix of the ranking, so in any one
// configuration only the strictest of them decides; one test per filter
// makes each of them the deciding one.

#[test]
fn sampled_frequencies_match_when_top_k_decides() {
    // Top-k 3 keeps three; top-p 0.9 would keep six, min-p 0.2 six.
    let logits: Vec<f32> = PROBS.iter().map(|p| p.ln() as f32).collect();
    let counts = draw_counts(&logits, 0.8, 3, 0.9, 0.2);
    let want = expected(&logits, 0.8, 3, 0.9, 0.2);
    assert_eq!(want.iter().filter(|&&p| p > 0.0).count(), 3);
    assert_fits(
        &counts,
        &want,
        &[
            ("no temperature", expected(&logits, 1.0, 3, 0.9, 0.2)),
            ("no top-k", expected(&logits, 0.8, 8, 0.9, 0.2)),
            ("top-k off by one", expected(&logits, 0.8, 4, 0.9, 0.2)),
        ],
    );
}

#[test]
fn sampled_frequencies_match_when_top_p_decides() {
    // Exclusive mass 0, 0.30, 0.50 < 0.6 keeps three; top-k 7 and min-p
    // 0.2 (six) do not decide.
    let logits: Vec<f32> = PROBS.iter().map(|p| p.ln() as f32).collect();
    let counts = draw_counts(&logits, 1.3, 7, 0.6, 0.2);
    let want = expected(&logits, 1.3, 7, 0.6, 0.2);
    assert_eq!(want.iter().filter(|&&p| p > 0.0).count(), 3);
    assert_fits(
        &counts,
        &want,
        &[
            ("no temperature", expected(&logits, 1.0, 7, 0.6, 0.2)),
            ("no top-p", expected(&logits, 1.3, 7, 1.0, 0.2)),
            // Inclusive cumsum < 0.6 keeps two, like exclusive at 0.5.
            ("inclusive top-p", expected(&logits, 1.3, 7, 0.5, 0.2)),
            // The tempered distribution's exclusive mass stays below 0.6
            // for four tokens, like the untempered one at 0.66.
            (
                "top-p after temperature",
                expected(&logits, 1.3, 7, 0.66, 0.2),
            ),
        ],
    );
}

#[test]
fn sampled_frequencies_match_when_min_p_decides() {
    // Min-p 0.35 (threshold 0.105) keeps four; top-k 5 and top-p 0.9 more.
    let logits: Vec<f32> = PROBS.iter().map(|p| p.ln() as f32).collect();
    let counts = draw_counts(&logits, 0.8, 5, 0.9, 0.35);
    let want = expected(&logits, 0.8, 5, 0.9, 0.35);
    assert_eq!(want.iter().filter(|&&p| p > 0.0).count(), 4);
    assert_fits(
        &counts,
        &want,
        &[
            ("no temperature", expected(&logits, 1.0, 5, 0.9, 0.35)),
            ("no min-p", expected(&logits, 0.8, 5, 0.9, 1e-9)),
            // Judged after the temperature: threshold 0.35^0.8 × max.
            (
                "min-p after temperature",
                expected(&logits, 0.8, 5, 0.9, 0.35f64.powf(0.8)),
            ),
        ],
    );
}

#[test]
fn sampled_frequencies_match_without_truncation() {
    // The dense path (no top-k / top-p): every token, tempered.
    let logits: Vec<f32> = PROBS.iter().map(|p| p.ln() as f32).collect();
    let counts = draw_counts(&logits, 0.7, 0, 1.0, 0.0);
    let want = expected(&logits, 0.7, 8, 1.0, 1e-9);
    assert_fits(
        &counts,
        &want,
        &[("no temperature", expected(&logits, 1.0, 8, 1.0, 1e-9))],
    );
}

#[test]
fn greedy_rows_use_no_randomness() {
    // A greedy slot sharing the batch with sampled slots is deterministic
    // and does not consume the others' randomness.
    let v = 10;
    let mut s = Sampler::with_seed(16, 1);
    s.add(1, SamplingOptions::default(), &[]).unwrap();
    s.add(
        2,
        SamplingOptions {
            temperature: 1.0,
            seed: Some(4),
            ..SamplingOptions::default()
        },
        &[],
    )
    .unwrap();
    let mut t = Sampler::with_seed(16, 1);
    t.add(
        2,
        SamplingOptions {
            temperature: 1.0,
            seed: Some(4),
            ..SamplingOptions::default()
        },
        &[],
    )
    .unwrap();
    let row: Vec<f32> = (0..v).map(|i| (i % 4) as f32).collect();
    for _ in 0..30 {
        let both = s
            .sample(&[1, 2], &tensor(&[row.clone(), row.clone()], v))
            .unwrap();
        let one = t
            .sample(&[2], &tensor(std::slice::from_ref(&row), v))
            .unwrap();
        assert_eq!(both.tokens[0], 3, "first maximum");
        assert_eq!(both.tokens[1], one.tokens[0]);
    }
}
