//! Grammar masks and logit bias in the batched sampler: a masked token is
//! never drawn on either path, whatever the other transforms do; a masked
//! row gets the same token alone or in a mixed batch; the bias applies
//! before the chain and is checked against the vocabulary.

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tandem::sampler::{LogitBias, SamplePath, Sampler, SamplerError, SamplingOptions, TokenMask};

const V: usize = 300;

fn random_logits(rows: usize, seed: u64) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let data: Vec<f32> = (0..rows * V).map(|_| rng.random_range(-4.0..4.0)).collect();
    Tensor::from_vec(data, (rows, V), &Device::Cpu).unwrap()
}

fn random_mask(seed: u64, keep_one_in: u32) -> TokenMask {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let allowed: Vec<u32> = (0..V as u32)
        .filter(|_| rng.random_range(0..keep_one_in) == 0)
        .chain([V as u32 - 1]) // never empty
        .collect();
    TokenMask::allowing(&allowed)
}

fn option_sets() -> Vec<SamplingOptions> {
    let base = SamplingOptions {
        repeat_last_n: 0,
        ..SamplingOptions::default()
    };
    vec![
        base,
        SamplingOptions {
            temperature: 1.0,
            ..base
        },
        SamplingOptions {
            temperature: 0.8,
            top_k: 5,
            ..base
        },
        SamplingOptions {
            temperature: 1.2,
            top_p: 0.5,
            min_p: 0.05,
            ..base
        },
        SamplingOptions {
            temperature: 1.0,
            repeat_last_n: 8,
            repeat_penalty: 0.5, // boosts repeats: a masked prior must stay out
            presence_penalty: -2.0,
            ..base
        },
    ]
}

#[test]
fn a_masked_token_is_never_drawn_on_either_path() {
    for (o, options) in option_sets().into_iter().enumerate() {
        for trial in 0..20u64 {
            let b = 4;
            let make = || {
                let mut s = Sampler::with_seed(64, trial);
                for slot in 0..b as u32 {
                    let opts = SamplingOptions {
                        seed: Some(trial * 10 + u64::from(slot)),
                        ..options
                    };
                    // Priors the mask forbids: penalties that boost them must not matter.
                    s.add(slot, opts, &[0, 1, 2, 3]).unwrap();
                }
                s
            };
            let (mut s, mut serial) = (make(), make());
            let masks: Vec<TokenMask> = (0..b as u64)
                .map(|r| random_mask(trial * 7 + r, 9))
                .collect();
            let rows: Vec<Option<&TokenMask>> = masks.iter().map(Some).collect();
            let slots: Vec<u32> = (0..b as u32).collect();
            let logits = random_logits(b, trial);
            let uniform = s.sample_masked(&slots, &logits, &rows).unwrap();
            let forced = serial
                .sample_masked_serial_for_test(&slots, &logits, &rows)
                .unwrap();
            assert_eq!(uniform.tokens, forced.tokens, "options {o} trial {trial}");
            for (row, &t) in uniform.tokens.iter().enumerate() {
                assert!(
                    masks[row].allows(t),
                    "options {o} trial {trial} row {row}: {t}"
                );
            }
        }
    }
}

#[test]
fn masks_keep_the_uniform_path() {
    let mut s = Sampler::with_seed(64, 1);
    for slot in 0..3 {
        s.add(slot, SamplingOptions::greedy(), &[]).unwrap();
    }
    let m = TokenMask::allowing(&[7]);
    let r = s
        .sample_masked(&[0, 1, 2], &random_logits(3, 5), &[None, Some(&m), None])
        .unwrap();
    assert_eq!(r.path, SamplePath::Uniform);
    assert_eq!(r.tokens[1], 7);
}

#[test]
fn a_masked_row_samples_the_same_alone_or_in_a_mixed_batch() {
    let sampled = SamplingOptions {
        temperature: 0.9,
        top_p: 0.9,
        repeat_last_n: 0,
        seed: Some(42),
        ..SamplingOptions::default()
    };
    let mask = random_mask(3, 4);
    let steps = 12;
    // Alone: slot 5 only.
    let mut alone = Sampler::with_seed(64, 9);
    alone.add(5, sampled, &[]).unwrap();
    // Mixed: slot 5 between unconstrained greedy and sampled neighbours.
    let mut mixed = Sampler::with_seed(64, 9);
    mixed.add(1, SamplingOptions::greedy(), &[]).unwrap();
    mixed.add(5, sampled, &[]).unwrap();
    mixed
        .add(
            2,
            SamplingOptions {
                temperature: 1.0,
                seed: Some(1),
                ..SamplingOptions::default()
            },
            &[],
        )
        .unwrap();
    for step in 0..steps {
        let three = random_logits(3, 100 + step);
        let own = three.narrow(0, 1, 1).unwrap();
        let a = alone.sample_masked(&[5], &own, &[Some(&mask)]).unwrap();
        let m = mixed
            .sample_masked(&[1, 5, 2], &three, &[None, Some(&mask), None])
            .unwrap();
        assert_eq!(a.tokens[0], m.tokens[1], "step {step}");
        assert!(mask.allows(a.tokens[0]));
    }
}

#[test]
fn a_row_with_nothing_allowed_fails_and_commits_nothing() {
    let mut s = Sampler::with_seed(64, 1);
    s.add(0, SamplingOptions::greedy(), &[]).unwrap();
    let none = TokenMask::allowing(&[]);
    let err = s
        .sample_masked(&[0], &random_logits(1, 1), &[Some(&none)])
        .unwrap_err();
    assert!(matches!(err, SamplerError::NoFiniteLogit { .. }), "{err:?}");
    let wrong = s
        .sample_masked(&[0], &random_logits(1, 1), &[None, None])
        .unwrap_err();
    assert!(
        matches!(wrong, SamplerError::LogitsShape { .. }),
        "{wrong:?}"
    );
}

#[test]
fn logit_bias_applies_before_the_chain_and_is_range_checked() {
    let logits = random_logits(1, 3);
    let mut s = Sampler::with_seed(64, 1);
    s.add(0, SamplingOptions::greedy(), &[]).unwrap();
    let free = s.sample(&[0], &logits).unwrap().tokens[0];
    s.set_logit_bias(0, LogitBias::new([(free, -100.0)]))
        .unwrap();
    assert!(!s.is_plain_greedy(0), "a biased slot is not plain greedy");
    let second = s.sample(&[0], &logits).unwrap().tokens[0];
    assert_ne!(second, free, "-100 removes the argmax");
    s.set_logit_bias(0, LogitBias::new([(17, 100.0)])).unwrap();
    assert_eq!(s.sample(&[0], &logits).unwrap().tokens[0], 17);
    s.set_logit_bias(0, LogitBias::new([(V as u32, 1.0)]))
        .unwrap();
    let err = s.sample(&[0], &logits).unwrap_err();
    assert!(matches!(err, SamplerError::VocabMismatch { token, .. } if token == V as u32));
    assert!(matches!(
        s.set_logit_bias(9, LogitBias::default()),
        Err(SamplerError::UnknownSlot(9))
    ));
}
