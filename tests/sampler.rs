//! Behaviour of the batched sampler: a table of options and their expected
//! tokens, the history window and its ring wrap, batched calls equal to
//! per-slot calls on every dispatch branch, no history leak after remove,
//! per-row logprobs.
//! Paths, seeding and errors are in `sampler_api.rs`, property and
//! statistical tests in `sampler_props.rs`, MTP hooks in
//! `sampler_speculative.rs`.

use candle_core::{Device, Tensor};
use tandem::sampler::{SamplePath, SampleResult, Sampler, SamplingOptions};

/// Every option at zero, the base the cases below change one field of:
/// greedy, no truncation, no penalties (window 0). Note `top_p` and
/// `repeat_penalty` at 0 rather than their neutral 1: zero must mean "off".
fn zero() -> SamplingOptions {
    SamplingOptions {
        temperature: 0.0,
        top_k: 0,
        top_p: 0.0,
        min_p: 0.0,
        repeat_penalty: 0.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        repeat_last_n: 0,
        logprobs: false,
        top_logprobs: 0,
        seed: Some(7),
    }
}

fn logits(rows: &[&[f32]]) -> Tensor {
    let v = rows[0].len();
    let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_vec(flat, (rows.len(), v), &Device::Cpu).unwrap()
}

fn log_of(p: f64) -> f32 {
    p.ln() as f32
}

fn sample_one(opts: SamplingOptions, priors: &[u32], values: &[f32]) -> u32 {
    let mut s = Sampler::with_seed(128, 1);
    s.add(0, opts, priors).unwrap();
    s.sample(&[0], &logits(&[values])).unwrap().tokens[0]
}

#[test]
fn single_slot_options_table() {
    // (name, options, priors, logits, expected token)
    type Case = (&'static str, SamplingOptions, Vec<u32>, Vec<f32>, u32);
    let cases: Vec<Case> = vec![
        (
            // token 1: 5 - 6 = -1, so the argmax moves to 2
            "presence penalty",
            SamplingOptions {
                repeat_last_n: 1,
                presence_penalty: 6.0,
                ..zero()
            },
            vec![1],
            vec![0.0, 5.0, 4.0],
            2,
        ),
        (
            // positive logit divided: 5 / 2 = 2.5 < 4
            "repeat penalty on positive logits",
            SamplingOptions {
                repeat_last_n: 1,
                repeat_penalty: 2.0,
                ..zero()
            },
            vec![1],
            vec![0.0, 5.0, 4.0],
            2,
        ),
        (
            // negative logit multiplied: -1 * 4 = -4 < -3
            "repeat penalty on negative logits",
            SamplingOptions {
                repeat_last_n: 1,
                repeat_penalty: 4.0,
                ..zero()
            },
            vec![1],
            vec![-5.0, -1.0, -3.0],
            2,
        ),
        (
            // counted per occurrence: 5 - 2 * 2 = 1 < 4
            "frequency penalty",
            SamplingOptions {
                repeat_last_n: 4,
                frequency_penalty: 2.0,
                ..zero()
            },
            vec![1, 1],
            vec![0.0, 5.0, 4.0],
            2,
        ),
        (
            // 3.6 - 3 once = 0.6 > 0.5 (twice would be -2.4): presence
            // counts a token once however often it repeats
            "presence penalty once per distinct token",
            SamplingOptions {
                repeat_last_n: 4,
                presence_penalty: 3.0,
                ..zero()
            },
            vec![1, 1],
            vec![0.5, 3.6, 0.0],
            1,
        ),
        (
            // 5 / 2 once = 2.5 > 2 (twice would be 1.25): the repeat
            // penalty also applies once per distinct token
            "repeat penalty once per distinct token",
            SamplingOptions {
                repeat_last_n: 4,
                repeat_penalty: 2.0,
                ..zero()
            },
            vec![1, 1],
            vec![0.0, 5.0, 2.0],
            1,
        ),
        (
            // only the argmax survives, so temperature cannot move it
            "top-k",
            SamplingOptions {
                temperature: 1.0,
                top_k: 1,
                ..zero()
            },
            vec![],
            vec![1.0, 5.0, 4.0],
            1,
        ),
        (
            // exclusive cumsum 0 < 0.4 keeps token 0, 0.5 >= 0.4 drops the rest
            "top-p",
            SamplingOptions {
                temperature: 1.0,
                top_p: 0.4,
                ..zero()
            },
            vec![],
            vec![log_of(0.5), log_of(0.3), log_of(0.2)],
            0,
        ),
        (
            // threshold 0.5 * 0.7 = 0.35 drops 0.3 and 0.2
            "min-p",
            SamplingOptions {
                temperature: 1.0,
                min_p: 0.7,
                ..zero()
            },
            vec![],
            vec![log_of(0.5), log_of(0.3), log_of(0.2)],
            0,
        ),
        (
            // 0 = disabled whatever the coefficients
            "repeat_last_n = 0 disables penalties",
            SamplingOptions {
                repeat_last_n: 0,
                repeat_penalty: 2.0,
                presence_penalty: 10.0,
                ..zero()
            },
            vec![1],
            vec![0.0, 5.0, 4.0],
            1,
        ),
        (
            // -1 resolves to num_ctx (128), so the penalty applies
            "repeat_last_n = -1 resolves to num_ctx",
            SamplingOptions {
                repeat_last_n: -1,
                presence_penalty: 6.0,
                ..zero()
            },
            vec![1],
            vec![0.0, 5.0, 4.0],
            2,
        ),
        (
            // repeat_penalty <= 0 means 1 (neutral): the argmax stays
            "non-positive repeat penalty is neutral",
            SamplingOptions {
                repeat_last_n: 4,
                repeat_penalty: -3.0,
                ..zero()
            },
            vec![1],
            vec![0.0, 5.0, 4.0],
            1,
        ),
        (
            // greedy ties go to the first maximum
            "greedy takes the first of tied maxima",
            zero(),
            vec![],
            vec![1.0, 7.0, 3.0, 7.0],
            1,
        ),
        (
            // top-k 1 on a tie keeps the lower id (positional, deterministic)
            "top-k tie keeps the lower id",
            SamplingOptions {
                temperature: 1.0,
                top_k: 1,
                ..zero()
            },
            vec![],
            vec![1.0, 7.0, 3.0, 7.0],
            1,
        ),
        (
            // the window holds only the last 2 priors, so token 0 is free
            "priors are trimmed to the window",
            SamplingOptions {
                repeat_last_n: 2,
                presence_penalty: 10.0,
                ..zero()
            },
            vec![0, 1, 2],
            vec![5.0, 4.9, 4.8, 0.0],
            0,
        ),
    ];
    for (name, opts, priors, values, want) in cases {
        assert_eq!(sample_one(opts, &priors, &values), want, "case {name}");
    }
}

#[test]
fn history_window_trims_priors_and_wraps() {
    let mut s = Sampler::with_seed(128, 1);
    // Window 2 keeps priors {2, 3}; token 1 is not penalised.
    let opts = SamplingOptions {
        repeat_last_n: 2,
        presence_penalty: 10.0,
        ..zero()
    };
    s.add(0, opts, &[1, 2, 3]).unwrap();
    assert_eq!(s.history(0).unwrap(), vec![2, 3]);
    let r = s
        .sample(&[0], &logits(&[&[0.0, 5.0, 0.0, 0.0, 0.0]]))
        .unwrap();
    assert_eq!(r.tokens, vec![1], "token 1 was trimmed from the priors");
    // The write went to ring position 2 % 2 = 0, over the oldest (2).
    assert_eq!(s.history(0).unwrap(), vec![3, 1]);
    let r = s
        .sample(&[0], &logits(&[&[0.0, 0.0, 5.0, 0.0, 0.0]]))
        .unwrap();
    assert_eq!(r.tokens, vec![2], "token 2 rotated out of the ring");
    assert_eq!(s.history(0).unwrap(), vec![1, 2]);
    // Token 3 has rotated out as well; 1 and 2 are penalised.
    let r = s
        .sample(&[0], &logits(&[&[0.0, 5.0, 5.0, 4.0, 0.0]]))
        .unwrap();
    assert_eq!(r.tokens, vec![3]);
}

struct SlotSpec {
    id: u32,
    opts: SamplingOptions,
    priors: Vec<u32>,
}

fn spec(id: u32, opts: SamplingOptions, priors: &[u32]) -> SlotSpec {
    SlotSpec {
        id,
        opts,
        priors: priors.to_vec(),
    }
}

/// Registers every slot, samples `order` in one call, and checks each row
/// against the slot sampled alone; returns the batched path.
fn batched_matches_per_slot(slots: &[SlotSpec], order: &[u32], rows: &[&[f32]]) -> SamplePath {
    let mut batched = Sampler::with_seed(128, 1);
    for s in slots {
        batched.add(s.id, s.opts, &s.priors).unwrap();
    }
    let res = batched.sample(order, &logits(rows)).unwrap();
    for (i, id) in order.iter().enumerate() {
        let s = slots.iter().find(|s| s.id == *id).unwrap();
        let alone = sample_one(s.opts, &s.priors, rows[i]);
        assert_eq!(res.tokens[i], alone, "slot {id}: batched vs per-slot");
    }
    res.path
}

#[test]
fn batched_equals_per_slot_across_dispatch_branches() {
    let pres = |n, p| SamplingOptions {
        repeat_last_n: n,
        presence_penalty: p,
        ..zero()
    };

    let path = batched_matches_per_slot(
        &[
            spec(10, pres(2, 5.0), &[1, 2]),
            spec(20, pres(2, 5.0), &[0, 2]),
        ],
        &[10, 20],
        &[&[0.0, 5.0, 4.0], &[3.0, 0.0, 0.0]],
    );
    assert_eq!(path, SamplePath::Uniform, "shared options, full rings");

    let path = batched_matches_per_slot(
        &[
            spec(
                1,
                SamplingOptions {
                    repeat_last_n: 1,
                    repeat_penalty: 2.0,
                    ..zero()
                },
                &[1],
            ),
            spec(
                2,
                SamplingOptions {
                    temperature: 1.0,
                    top_k: 1,
                    ..zero()
                },
                &[],
            ),
        ],
        &[1, 2],
        &[&[0.0, 5.0, 4.0, 1.0], &[2.0, 1.0, 5.0, 3.0]],
    );
    assert_eq!(path, SamplePath::Serial, "mixed options");

    let path = batched_matches_per_slot(
        &[
            spec(1, pres(4, 5.0), &[1, 1, 1, 1]),
            spec(2, pres(4, 5.0), &[2]),
        ],
        &[1, 2],
        &[&[0.0, 5.0, 4.0], &[0.0, 4.0, 5.0]],
    );
    assert_eq!(path, SamplePath::Serial, "slot 2's ring is partial");

    let path = batched_matches_per_slot(
        &[
            spec(10, pres(2, 10.0), &[1, 1]),
            spec(20, pres(2, 10.0), &[2, 2]),
            spec(30, pres(2, 10.0), &[3, 3]),
        ],
        &[30, 10],
        &[
            &[5.0, 5.0, 5.0, 0.0, 5.0, 5.0],
            &[5.0, 0.0, 5.0, 5.0, 0.0, 5.0],
        ],
    );
    assert_eq!(
        path,
        SamplePath::Serial,
        "subset out of order with penalties"
    );

    let path = batched_matches_per_slot(
        &[
            spec(
                10,
                SamplingOptions {
                    seed: Some(1),
                    temperature: 0.8,
                    top_k: 2,
                    ..zero()
                },
                &[],
            ),
            spec(
                20,
                SamplingOptions {
                    seed: Some(2),
                    temperature: 0.8,
                    top_k: 2,
                    ..zero()
                },
                &[],
            ),
            spec(
                30,
                SamplingOptions {
                    seed: Some(3),
                    temperature: 0.8,
                    top_k: 2,
                    ..zero()
                },
                &[],
            ),
        ],
        &[30, 10],
        &[&[1.0, 2.0, 3.0], &[3.0, 2.0, 3.0]],
    );
    assert_eq!(
        path,
        SamplePath::Uniform,
        "no penalties: any subset, any order"
    );
}

#[test]
fn remove_does_not_leak_history_into_a_recycled_row() {
    let opts = SamplingOptions {
        repeat_last_n: 1,
        presence_penalty: 10.0,
        ..zero()
    };
    let mut s = Sampler::with_seed(128, 1);
    s.add(1, opts, &[1]).unwrap();
    s.add(2, opts, &[2]).unwrap();
    assert!(s.remove(1));
    assert!(!s.remove(1), "second remove is a no-op");
    s.add(3, opts, &[0]).unwrap();
    let res = s
        .sample(&[2, 3], &logits(&[&[3.0, 3.0, 0.0], &[3.0, 3.0, 0.0]]))
        .unwrap();
    assert_eq!(res.tokens[0], 0, "slot 2: token 2 penalised");
    assert_eq!(
        res.tokens[1], 1,
        "slot 3: token 0 penalised, nothing of slot 1"
    );
    assert_eq!(res.path, SamplePath::Uniform);
    // A slot added with no priors after a removal starts with an empty ring.
    s.remove(2);
    s.add(4, opts, &[]).unwrap();
    assert_eq!(s.history(4).unwrap(), Vec::<u32>::new());
    let res = s.sample(&[4], &logits(&[&[0.0, 3.0, 3.0]])).unwrap();
    assert_eq!(res.tokens, vec![1]);
}

fn run_logprobs(values: &[f32], k: usize) -> (u32, f32, Vec<(u32, f32)>) {
    let mut s = Sampler::with_seed(128, 1);
    s.add(
        0,
        SamplingOptions {
            logprobs: true,
            top_logprobs: k,
            ..zero()
        },
        &[],
    )
    .unwrap();
    let res = s.sample(&[0], &logits(&[values])).unwrap();
    (
        res.tokens[0],
        res.logprobs.unwrap()[0],
        res.top_logprobs.unwrap_or_default().concat(),
    )
}

fn reference_log_softmax(values: &[f32]) -> Vec<f64> {
    let m = values
        .iter()
        .fold(f64::NEG_INFINITY, |a, &b| a.max(f64::from(b)));
    let lse = values
        .iter()
        .map(|&x| (f64::from(x) - m).exp())
        .sum::<f64>()
        .ln();
    values.iter().map(|&x| f64::from(x) - m - lse).collect()
}

#[test]
fn logprob_of_the_selected_token_is_correct() {
    for values in [
        vec![1.0f32, 2.0, 3.0],
        vec![-1.5, 0.25, 0.5, -3.0],
        vec![1000.0, 999.0, 998.5], // large values: stable log-softmax needed
    ] {
        let (token, lp, _) = run_logprobs(&values, 0);
        let want = reference_log_softmax(&values)[token as usize];
        assert!(
            (f64::from(lp) - want).abs() < 1e-5,
            "{values:?}: {lp} vs {want}"
        );
    }
}

#[test]
fn top_logprobs_are_sorted_descending() {
    // argmax order differs from index order
    let values = [2.0f32, 5.0, 1.0, 4.0, 3.0];
    let (_, _, top) = run_logprobs(&values, 3);
    let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
    assert_eq!(ids, vec![1, 3, 4]);
    let want = reference_log_softmax(&values);
    for (id, lp) in &top {
        assert!((f64::from(*lp) - want[*id as usize]).abs() < 1e-5);
    }
    // Asking for more than V gives V entries.
    let (_, _, top) = run_logprobs(&[0.0, 1.0], 5);
    assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 0]);
}

#[test]
fn batched_logprobs_are_per_row() {
    let row_a = [2.0f32, 1.0, 0.0];
    let row_b = [0.0f32, 5.0, 0.0];
    let (_, want_a, _) = run_logprobs(&row_a, 0);
    let (_, want_b, _) = run_logprobs(&row_b, 0);
    let mut s = Sampler::with_seed(128, 1);
    s.add(
        1,
        SamplingOptions {
            logprobs: true,
            ..zero()
        },
        &[],
    )
    .unwrap();
    s.add(
        2,
        SamplingOptions {
            logprobs: true,
            ..zero()
        },
        &[],
    )
    .unwrap();
    let res = s.sample(&[1, 2], &logits(&[&row_a, &row_b])).unwrap();
    let got = res.logprobs.unwrap();
    assert_eq!(got.len(), 2);
    assert!(
        (got[0] - want_a).abs() < 1e-5,
        "row 0: {} vs {want_a}",
        got[0]
    );
    assert!(
        (got[1] - want_b).abs() < 1e-5,
        "row 1: {} vs {want_b}",
        got[1]
    );
}

#[test]
fn logprobs_are_computed_for_all_and_cut_per_request() {
    let mut s = Sampler::with_seed(128, 1);
    let none = zero();
    let some = SamplingOptions {
        logprobs: true,
        top_logprobs: 1,
        ..zero()
    };
    let most = SamplingOptions {
        logprobs: true,
        top_logprobs: 3,
        ..zero()
    };
    s.add(1, none, &[]).unwrap();
    s.add(2, some, &[]).unwrap();
    s.add(3, most, &[]).unwrap();
    let rows: [&[f32]; 2] = [&[0.0, 1.0, 2.0, 3.0], &[3.0, 2.0, 1.0, 0.0]];
    // Slot 3 is not in the call but still sets K = 3 for every row.
    let res = s.sample(&[2, 1], &logits(&rows)).unwrap();
    let top = res.top_logprobs.clone().unwrap();
    assert_eq!(
        top[0].iter().map(|t| t.0).collect::<Vec<_>>(),
        vec![3, 2, 1]
    );
    assert_eq!(
        top[1].iter().map(|t| t.0).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert_eq!(res.logprobs.as_ref().unwrap().len(), 2);
    let (lp, cut) = res.for_row(0, &some);
    assert_eq!(lp, Some(res.logprobs.as_ref().unwrap()[0]));
    assert_eq!(cut, top[0][..1].to_vec());
    assert_eq!(res.for_row(1, &none), (None, vec![]));
    assert_eq!(res.for_row(9, &some), (None, vec![]), "out of range row");
    // Once no registered slot asks, nothing is computed.
    s.remove(2);
    s.remove(3);
    let res: SampleResult = s.sample(&[1], &logits(&rows[..1])).unwrap();
    assert_eq!((res.logprobs, res.top_logprobs), (None, None));
}
