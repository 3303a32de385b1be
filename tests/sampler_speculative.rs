//! The sampler's MTP hooks: `speculative_distributions` must be exactly
//! what `sample` draws from after the prefix is appended, `commit` appends,
//! `draw_at` draws with the uniform keyed by (seed, generation index) that
//! `sample` uses there, and `logprobs_at` reports what `sample` reports.

use candle_core::{Device, Tensor};
use tandem::sampler::{Sampler, SamplerError, SamplingOptions};

const V: usize = 24;

fn rows(t: usize, salt: usize) -> Vec<Vec<f32>> {
    (0..t)
        .map(|p| {
            (0..V)
                .map(|i| (((i * 17 + p * 5 + salt * 3) % 11) as f32) * 0.4 - 1.0)
                .collect()
        })
        .collect()
}

fn tensor(rows: &[Vec<f32>]) -> Tensor {
    let flat: Vec<f32> = rows.concat();
    Tensor::from_vec(flat, (rows.len(), V), &Device::Cpu).unwrap()
}

fn penalised(temperature: f32) -> SamplingOptions {
    SamplingOptions {
        temperature,
        top_k: 8,
        top_p: 0.95,
        repeat_penalty: 1.3,
        presence_penalty: 0.4,
        frequency_penalty: 0.3,
        repeat_last_n: 3,
        seed: Some(11),
        ..SamplingOptions::default()
    }
}

/// Samples the T rows one call at a time (each token appended), returning
/// the tokens — the reference the speculative view must reproduce.
fn sample_sequentially(opts: SamplingOptions, priors: &[u32], rows: &[Vec<f32>]) -> Vec<u32> {
    let mut s = Sampler::with_seed(64, 1);
    s.add(3, opts, priors).unwrap();
    rows.iter()
        .map(|r| {
            s.sample(&[3], &tensor(std::slice::from_ref(r)))
                .unwrap()
                .tokens[0]
        })
        .collect()
}

#[test]
fn greedy_distributions_are_one_hot_on_what_sample_picks() {
    let opts = penalised(0.0);
    let priors = [4, 5, 6, 7];
    let rows = rows(6, 1);
    let want = sample_sequentially(opts, &priors, &rows);
    let mut s = Sampler::with_seed(64, 1);
    s.add(3, opts, &priors).unwrap();
    let dists = s
        .speculative_distributions(3, &tensor(&rows), &want[..5])
        .unwrap();
    assert_eq!(dists.len(), 6);
    for (i, d) in dists.iter().enumerate() {
        assert_eq!(d.len(), V);
        assert_eq!(d.iter().filter(|&&p| p != 0.0).count(), 1, "position {i}");
        assert_eq!(d[want[i] as usize], 1.0, "position {i}");
    }
    // The penalties saw the drafts: sampling without them differs here.
    let blind: Vec<u32> = rows
        .iter()
        .map(|r| {
            let mut t = Sampler::with_seed(64, 1);
            t.add(3, opts, &priors).unwrap();
            t.sample(&[3], &tensor(std::slice::from_ref(r)))
                .unwrap()
                .tokens[0]
        })
        .collect();
    assert_ne!(blind, want, "the test data must make the prefix matter");
}

#[test]
fn sampled_distributions_draw_the_tokens_sample_draws() {
    let opts = penalised(0.8);
    let priors = [1, 2];
    for salt in 0..20 {
        let rows = rows(5, salt);
        let want = sample_sequentially(opts, &priors, &rows);
        let mut s = Sampler::with_seed(64, 1);
        s.add(3, opts, &priors).unwrap();
        let dists = s
            .speculative_distributions(3, &tensor(&rows), &want[..4])
            .unwrap();
        for (i, d) in dists.iter().enumerate() {
            let sum: f32 = d.iter().sum();
            assert!((sum - 1.0).abs() < 1e-5, "position {i} sums to {sum}");
            assert!(
                d.iter().filter(|&&p| p > 0.0).count() <= 8,
                "top-k bounds support"
            );
            // Same keyed uniform, same walk: the very token sample picked.
            assert_eq!(
                s.draw_at(3, i, d).unwrap(),
                want[i],
                "salt {salt} position {i}"
            );
        }
    }
}

#[test]
fn speculation_changes_nothing_and_commit_appends() {
    let opts = penalised(0.8);
    let mut s = Sampler::with_seed(64, 1);
    s.add(3, opts, &[1, 2]).unwrap();
    let rows = rows(3, 2);
    let a = s
        .speculative_distributions(3, &tensor(&rows), &[5, 6])
        .unwrap();
    let b = s
        .speculative_distributions(3, &tensor(&rows), &[5, 6, 7])
        .unwrap();
    assert_eq!(a, b, "extra drafts are ignored and nothing was committed");
    assert_eq!(s.history(3).unwrap(), vec![1, 2]);
    s.commit(3, &[5, 6]).unwrap();
    assert_eq!(s.history(3).unwrap(), vec![2, 5, 6], "window of 3 wraps");
    // After committing, position 0 sees what position 2 saw before.
    let after = s
        .speculative_distributions(3, &tensor(&rows[2..]), &[])
        .unwrap();
    assert_eq!(after[0], a[2]);
    // Commit of a slot without penalties is accepted and keeps no history.
    s.add(4, SamplingOptions::default(), &[]).unwrap();
    s.commit(4, &[1, 2, 3]).unwrap();
    assert_eq!(s.history(4).unwrap(), Vec::<u32>::new());
}

#[test]
fn draw_at_is_keyed_by_seed_and_generation_index() {
    let seeded = |seed| SamplingOptions {
        temperature: 1.0,
        seed: Some(seed),
        ..SamplingOptions::default()
    };
    let mk = || {
        let mut s = Sampler::with_seed(64, 99);
        s.add(1, seeded(5), &[]).unwrap();
        s.add(2, seeded(6), &[]).unwrap();
        s
    };
    let weights = [0.0f32, 0.3, 0.0, 0.9, 0.2];
    let logits: Vec<f32> = weights
        .iter()
        .map(|&w| if w > 0.0 { w.ln() } else { f32::NEG_INFINITY })
        .collect();
    let row = Tensor::from_vec(logits, (1, 5), &Device::Cpu).unwrap();
    // What sequential sampling emits at generation 0..50.
    let mut a = mk();
    let sampled: Vec<u32> = (0..50)
        .map(|_| a.sample(&[1], &row).unwrap().tokens[0])
        .collect();
    // draw_at reaches any of them without drawing the others, changes
    // nothing, and another slot's calls in between do not disturb it.
    let mut b = mk();
    for (n, &want) in sampled.iter().enumerate().rev() {
        b.sample(&[2], &row).unwrap();
        assert_eq!(b.draw_at(1, n, &weights).unwrap(), want, "index {n}");
    }
    // commit moves the index past the committed tokens.
    b.commit(1, &sampled[..7]).unwrap();
    assert_eq!(b.draw_at(1, 0, &weights).unwrap(), sampled[7]);
    assert_eq!(b.sample(&[1], &row).unwrap().tokens[0], sampled[7]);
    let counts = sampled.iter().fold([0; 5], |mut c, &d| {
        c[d as usize] += 1;
        c
    });
    assert!(counts[3] > counts[1] && counts[1] > 0, "{counts:?}");
    assert_eq!(counts[0] + counts[2], 0, "never a zero-weight index");
}

#[test]
fn logprobs_at_reports_what_sample_reports() {
    let opts = SamplingOptions {
        logprobs: true,
        top_logprobs: 3,
        ..penalised(0.8)
    };
    let rows = rows(4, 3);
    let mut s = Sampler::with_seed(64, 1);
    s.add(3, opts, &[1, 2]).unwrap();
    let want: Vec<(f32, Vec<(u32, f32)>)> = rows
        .iter()
        .map(|r| {
            let res = s.sample(&[3], &tensor(std::slice::from_ref(r))).unwrap();
            let (lp, top) = res.for_row(0, &opts);
            (lp.unwrap(), top)
        })
        .collect();
    let tokens: Vec<u32> = rows
        .iter()
        .zip(&want)
        .map(|(r, (lp, _))| {
            let max = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let lse = r.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
            // The token whose raw log-softmax is the reported logprob.
            r.iter()
                .position(|&x| ((x - max) - lse - lp).abs() < 1e-6)
                .unwrap() as u32
        })
        .collect();
    let mut fresh = Sampler::with_seed(64, 1);
    fresh.add(3, opts, &[1, 2]).unwrap();
    let got = fresh.logprobs_at(3, &tensor(&rows), &tokens).unwrap();
    assert_eq!(got.len(), 4);
    for (i, ((glp, gtop), (wlp, wtop))) in got.iter().zip(&want).enumerate() {
        assert!((glp - wlp).abs() < 1e-6, "row {i}: {glp} vs {wlp}");
        assert_eq!(gtop, wtop, "row {i}");
    }
    // A slot that did not ask gets nothing; bad input is typed.
    fresh.add(4, SamplingOptions::default(), &[]).unwrap();
    assert!(fresh
        .logprobs_at(4, &tensor(&rows), &[0])
        .unwrap()
        .is_empty());
    assert!(matches!(
        fresh.logprobs_at(3, &tensor(&rows), &[0, 0, 0, 0, 0]),
        Err(SamplerError::LogitsShape { .. })
    ));
    assert!(matches!(
        fresh.logprobs_at(3, &tensor(&rows), &[99]),
        Err(SamplerError::VocabMismatch { .. })
    ));
}

#[test]
fn speculative_errors_are_typed() {
    let mut s = Sampler::with_seed(64, 1);
    s.add(3, penalised(1.0), &[1]).unwrap();
    let rows = rows(3, 0);
    assert_eq!(
        s.speculative_distributions(3, &tensor(&rows), &[1]),
        Err(SamplerError::DraftTooShort {
            positions: 3,
            drafts: 1
        })
    );
    assert_eq!(
        s.speculative_distributions(3, &tensor(&rows), &[1, 99]),
        Err(SamplerError::VocabMismatch {
            slot: 3,
            token: 99,
            vocab: V
        })
    );
    assert_eq!(
        s.speculative_distributions(9, &tensor(&rows), &[1, 2]),
        Err(SamplerError::UnknownSlot(9))
    );
    for bad in [
        &[][..],
        &[0.0, 0.0][..],
        &[0.5, -0.1][..],
        &[f32::NAN][..],
        &[f32::INFINITY][..],
    ] {
        assert!(
            matches!(s.draw_at(3, 0, bad), Err(SamplerError::InvalidProbs { .. })),
            "{bad:?}"
        );
    }
    assert_eq!(s.draw_at(9, 0, &[1.0]), Err(SamplerError::UnknownSlot(9)));
}
