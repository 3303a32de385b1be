//! Sampler API contracts beyond `sampler.rs`'s behaviour: which path a call takes,
//! per-slot seeding across batches and paths, dtype and threading
//! independence, and typed errors that leave the state untouched.

use candle_core::{DType, Device, Tensor};
use tandem::sampler::{SamplePath, Sampler, SamplerError, SamplingOptions, MAX_TOP_LOGPROBS};

/// Greedy, no truncation, no penalties, fixed seed.
fn zero() -> SamplingOptions {
    SamplingOptions {
        top_p: 0.0,
        repeat_last_n: 0,
        seed: Some(7),
        ..SamplingOptions::default()
    }
}

fn logits(rows: &[&[f32]]) -> Tensor {
    let v = rows[0].len();
    let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_vec(flat, (rows.len(), v), &Device::Cpu).unwrap()
}

#[test]
fn pool_width_follows_the_largest_window() {
    let mut s = Sampler::with_seed(128, 1);
    s.add(1, zero(), &[5, 6]).unwrap();
    assert_eq!(s.history_width(), 0, "no penalty slot, no pool");
    s.add(
        2,
        SamplingOptions {
            repeat_last_n: 3,
            presence_penalty: 1.0,
            ..zero()
        },
        &[7],
    )
    .unwrap();
    assert_eq!(s.history_width(), 3);
    s.add(
        3,
        SamplingOptions {
            repeat_last_n: 8,
            frequency_penalty: 1.0,
            ..zero()
        },
        &[8, 9],
    )
    .unwrap();
    assert_eq!(s.history_width(), 8);
    assert_eq!(s.history(2).unwrap(), vec![7]);
    assert_eq!(s.history(3).unwrap(), vec![8, 9]);
    s.remove(3);
    assert_eq!(s.history_width(), 3);
    assert_eq!(s.history(2).unwrap(), vec![7]);
    s.remove(2);
    assert_eq!(s.history_width(), 0);
    // Penalty coefficients with a zero window do not allocate a pool.
    s.add(
        4,
        SamplingOptions {
            repeat_last_n: 0,
            presence_penalty: 1.0,
            ..zero()
        },
        &[1],
    )
    .unwrap();
    assert_eq!(s.history_width(), 0);
}

#[test]
fn sampler_is_send() {
    // The engine thread may build it elsewhere and move it in.
    fn assert_send<T: Send>() {}
    assert_send::<Sampler>();
}

#[test]
fn seeded_slots_repeat_whatever_shares_the_batch() {
    let opts = |seed| SamplingOptions {
        temperature: 1.0,
        top_p: 0.95,
        repeat_last_n: 4,
        frequency_penalty: 0.2,
        seed: Some(seed),
        ..SamplingOptions::default()
    };
    let v = 50;
    let row = |step: usize, salt: usize| -> Vec<f32> {
        (0..v)
            .map(|i| (((i * 31 + step * 7 + salt * 13) % 17) as f32) * 0.3)
            .collect()
    };
    // Alone.
    let mut alone = Sampler::with_seed(128, 1);
    alone.add(5, opts(42), &[1, 2, 3, 4]).unwrap();
    let mut solo = Vec::new();
    for step in 0..20 {
        let r = row(step, 0);
        solo.push(alone.sample(&[5], &logits(&[&r])).unwrap().tokens[0]);
    }
    // With companions (uniform: same plan, full rings, registration order).
    let mut crowd = Sampler::with_seed(128, 2);
    crowd.add(1, opts(7), &[9, 9, 9, 9]).unwrap();
    crowd.add(5, opts(42), &[1, 2, 3, 4]).unwrap();
    crowd.add(8, opts(8), &[0, 0, 0, 0]).unwrap();
    let mut mixed = Sampler::with_seed(128, 3);
    mixed.add(5, opts(42), &[1, 2, 3, 4]).unwrap();
    mixed
        .add(
            6,
            SamplingOptions {
                temperature: 0.5,
                ..opts(1)
            },
            &[],
        )
        .unwrap();
    for (step, want) in solo.iter().enumerate() {
        let (a, b, c) = (row(step, 1), row(step, 0), row(step, 2));
        let res = crowd.sample(&[1, 5, 8], &logits(&[&a, &b, &c])).unwrap();
        assert_eq!(res.path, SamplePath::Uniform);
        assert_eq!(res.tokens[1], *want, "uniform path, step {step}");
        let res = mixed.sample(&[6, 5], &logits(&[&a, &b])).unwrap();
        assert_eq!(res.path, SamplePath::Serial);
        assert_eq!(res.tokens[1], *want, "serial path, step {step}");
    }
    assert!(
        solo.iter().any(|&t| t != solo[0]),
        "the draws are not constant"
    );
}

#[test]
fn dtype_and_thread_split_do_not_change_tokens() {
    // bf16 goes through the conversion branch; 64 rows x 16384 logits are
    // enough for up to 4 threads on the uniform path, capped at 1, 2 and 3
    // (uneven chunks) here, against the serial path.
    let (b, v) = (64usize, 16384usize);
    let data: Vec<f32> = (0..b * v)
        .map(|i| ((i * 7919 % 1009) as f32) * 0.01)
        .collect();
    let t32 = Tensor::from_vec(data, (b, v), &Device::Cpu).unwrap();
    let t16 = t32.to_dtype(DType::BF16).unwrap();
    let back = t16.to_dtype(DType::F32).unwrap();
    let opts = |seed| SamplingOptions {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.9,
        repeat_last_n: 2,
        presence_penalty: 0.5,
        logprobs: seed % 2 == 0,
        top_logprobs: 3,
        seed: Some(seed),
        ..SamplingOptions::default()
    };
    let ids: Vec<u32> = (0..b as u32).collect();
    let mut results = Vec::new();
    for (t, threads) in [(&t16, 2), (&back, 1), (&back, 2), (&back, 3), (&back, 0)] {
        let mut s = Sampler::with_seed(128, 1);
        for &id in &ids {
            s.add(id, opts(u64::from(id)), &[id % 7, id % 5]).unwrap();
        }
        for _ in 0..3 {
            let res = if threads == 0 {
                s.sample_serial_for_bench(&ids, t).unwrap()
            } else {
                s.set_max_threads(threads);
                s.sample(&ids, t).unwrap()
            };
            let want = if threads == 0 {
                SamplePath::Serial
            } else {
                SamplePath::Uniform
            };
            assert_eq!(res.path, want);
            results.push((threads, res.tokens, res.logprobs, res.top_logprobs));
        }
    }
    assert!(results[0].2.is_some() && results[0].3.is_some());
    for step in 0..3 {
        let base = &results[step];
        for run in 1..5 {
            let other = &results[run * 3 + step];
            assert_eq!(other.1, base.1, "threads {} step {step}", other.0);
            assert_eq!(other.2, base.2, "threads {} step {step}", other.0);
            assert_eq!(other.3, base.3, "threads {} step {step}", other.0);
        }
    }
}

#[test]
fn path_rules() {
    let pen = SamplingOptions {
        repeat_last_n: 2,
        presence_penalty: 1.0,
        ..zero()
    };
    let mut s = Sampler::with_seed(128, 1);
    s.add(1, pen, &[1, 2]).unwrap();
    s.add(2, pen, &[3, 4]).unwrap();
    assert_eq!(s.path_for(&[1, 2]).unwrap(), SamplePath::Uniform);
    assert_eq!(
        s.path_for(&[2, 1]).unwrap(),
        SamplePath::Serial,
        "order matters"
    );
    assert_eq!(s.path_for(&[1]).unwrap(), SamplePath::Serial, "subset");
    // Differing seeds or logprob requests do not split the batch.
    s.add(
        3,
        SamplingOptions {
            seed: Some(99),
            logprobs: true,
            ..pen
        },
        &[5, 6],
    )
    .unwrap();
    assert_eq!(s.path_for(&[1, 2, 3]).unwrap(), SamplePath::Uniform);
    // A partial ring forces serial until it fills.
    s.add(4, pen, &[7]).unwrap();
    assert_eq!(s.path_for(&[1, 2, 3, 4]).unwrap(), SamplePath::Serial);
    let rows = [[0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]; 4];
    let refs: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
    let res = s.sample(&[1, 2, 3, 4], &logits(&refs)).unwrap();
    assert_eq!(res.path, SamplePath::Serial);
    assert_eq!(s.path_for(&[1, 2, 3, 4]).unwrap(), SamplePath::Uniform);
    let res = s.sample(&[1, 2, 3, 4], &logits(&refs)).unwrap();
    assert_eq!(res.path, SamplePath::Uniform);
    // A slot with other options makes every call serial.
    s.add(5, zero(), &[]).unwrap();
    assert_eq!(s.path_for(&[1, 2, 3, 4, 5]).unwrap(), SamplePath::Serial);
    s.remove(5);
    assert_eq!(s.path_for(&[1, 2, 3, 4]).unwrap(), SamplePath::Uniform);
    // An empty call is trivially uniform and returns nothing.
    let empty = Tensor::zeros((0, 9), DType::F32, &Device::Cpu).unwrap();
    let res = s.sample(&[], &empty).unwrap();
    assert!(res.tokens.is_empty());
}

fn invalid(field: &str, opts: SamplingOptions) {
    let mut s = Sampler::new(16);
    match s.add(1, opts, &[]) {
        Err(SamplerError::InvalidOption { field: f, reason }) => {
            assert_eq!(f, field, "{reason}");
            assert!(!reason.is_empty());
        }
        other => panic!("{field}: expected InvalidOption, got {other:?}"),
    }
    assert!(s.is_empty(), "a rejected slot is not registered");
}

#[test]
fn invalid_options_are_typed_errors() {
    invalid(
        "temperature",
        SamplingOptions {
            temperature: f32::NAN,
            ..zero()
        },
    );
    invalid(
        "temperature",
        SamplingOptions {
            temperature: -0.5,
            ..zero()
        },
    );
    invalid(
        "top_p",
        SamplingOptions {
            top_p: 1.5,
            ..zero()
        },
    );
    invalid(
        "top_p",
        SamplingOptions {
            top_p: -0.1,
            ..zero()
        },
    );
    invalid(
        "min_p",
        SamplingOptions {
            min_p: 2.0,
            ..zero()
        },
    );
    invalid(
        "top_k",
        SamplingOptions {
            top_k: -1,
            ..zero()
        },
    );
    invalid(
        "top_logprobs",
        SamplingOptions {
            top_logprobs: MAX_TOP_LOGPROBS + 1,
            ..zero()
        },
    );
    invalid(
        "repeat_penalty",
        SamplingOptions {
            repeat_penalty: f32::NAN,
            ..zero()
        },
    );
    invalid(
        "presence_penalty",
        SamplingOptions {
            presence_penalty: f32::NAN,
            ..zero()
        },
    );
    invalid(
        "frequency_penalty",
        SamplingOptions {
            frequency_penalty: f32::NAN,
            ..zero()
        },
    );
    invalid(
        "repeat_last_n",
        SamplingOptions {
            repeat_last_n: -2,
            ..zero()
        },
    );
}

#[test]
fn bad_calls_are_typed_errors_and_change_nothing() {
    let mut s = Sampler::with_seed(128, 1);
    let pen = SamplingOptions {
        repeat_last_n: 4,
        presence_penalty: 1.0,
        ..zero()
    };
    s.add(1, pen, &[0, 1]).unwrap();
    s.add(
        2,
        SamplingOptions {
            temperature: 1.0,
            ..zero()
        },
        &[],
    )
    .unwrap();
    assert_eq!(s.add(1, zero(), &[]), Err(SamplerError::DuplicateSlot(1)));
    let ok = logits(&[&[0.0, 1.0, 2.0], &[2.0, 1.0, 0.0]]);
    assert_eq!(s.sample(&[1, 7], &ok), Err(SamplerError::UnknownSlot(7)));
    assert_eq!(s.sample(&[1, 1], &ok), Err(SamplerError::RepeatedSlot(1)));
    assert!(matches!(
        s.sample(&[1], &ok),
        Err(SamplerError::LogitsShape { .. })
    ));
    let rank1 = Tensor::from_vec(vec![0.0f32, 1.0], 2, &Device::Cpu).unwrap();
    assert!(matches!(
        s.sample(&[1], &rank1),
        Err(SamplerError::LogitsShape { .. })
    ));
    let ints = Tensor::from_vec(vec![0u32, 1, 2], (1, 3), &Device::Cpu).unwrap();
    assert!(matches!(
        s.sample(&[1], &ints),
        Err(SamplerError::LogitsDType(_))
    ));
    let empty = Tensor::zeros((1, 0), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(s.sample(&[1], &empty), Err(SamplerError::EmptyVocab));
    // Prior token 1 does not exist in a vocabulary of 1.
    let tiny = logits(&[&[0.0]]);
    assert_eq!(
        s.sample(&[1], &tiny),
        Err(SamplerError::VocabMismatch {
            slot: 1,
            token: 1,
            vocab: 1
        })
    );
    let nan = logits(&[&[0.0, 1.0, 2.0], &[2.0, f32::NAN, 0.0]]);
    assert_eq!(
        s.sample(&[1, 2], &nan),
        Err(SamplerError::NonFiniteLogits { slot: 2, row: 1 })
    );
    let inf = logits(&[&[f32::INFINITY, 1.0, 2.0]]);
    assert_eq!(
        s.sample(&[2], &inf),
        Err(SamplerError::NonFiniteLogits { slot: 2, row: 0 })
    );
    let dead = logits(&[&[f32::NEG_INFINITY; 3]]);
    assert_eq!(
        s.sample(&[2], &dead),
        Err(SamplerError::NoFiniteLogit { slot: 2, row: 0 })
    );
    // A bad commit surfaces at the next call for that slot.
    s.commit(1, &[9]).unwrap();
    assert_eq!(
        s.sample(&[1], &logits(&[&[0.0, 1.0, 2.0]])),
        Err(SamplerError::VocabMismatch {
            slot: 1,
            token: 9,
            vocab: 3
        })
    );
    assert_eq!(
        s.history(1).unwrap(),
        vec![0, 1, 9],
        "failed calls append nothing"
    );
    assert_eq!(s.commit(3, &[0]), Err(SamplerError::UnknownSlot(3)));
    // Errors display their subject.
    let msg = SamplerError::VocabMismatch {
        slot: 4,
        token: 9,
        vocab: 3,
    }
    .to_string();
    assert!(
        msg.contains("slot 4") && msg.contains("9") && msg.contains("V = 3"),
        "{msg}"
    );
}

#[test]
fn failed_calls_do_not_advance_the_rng() {
    let opts = SamplingOptions {
        temperature: 1.0,
        seed: Some(3),
        ..SamplingOptions::default()
    };
    let row: Vec<f32> = (0..64).map(|i| (i % 5) as f32).collect();
    let mut a = Sampler::with_seed(16, 1);
    let mut b = Sampler::with_seed(16, 1);
    a.add(1, opts, &[]).unwrap();
    a.add(2, opts, &[]).unwrap();
    b.add(1, opts, &[]).unwrap();
    b.add(2, opts, &[]).unwrap();
    let mut bad = row.clone();
    bad[3] = f32::NAN;
    // Row 0 succeeds before row 1 fails; its draw must be rolled back.
    assert!(a.sample(&[1, 2], &logits(&[&row, &bad])).is_err());
    let x = a.sample(&[1, 2], &logits(&[&row, &row])).unwrap();
    let y = b.sample(&[1, 2], &logits(&[&row, &row])).unwrap();
    assert_eq!(x.tokens, y.tokens);
}
