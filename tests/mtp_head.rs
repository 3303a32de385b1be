//! The DeepSeek-style MTP head: checkpoint format, loader errors, and its
//! own KV (pairs fed in chunks == fed at once).

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use tandem::engine::SlotId;
use tandem::model::mtp::{mtp_tensor_shapes, random_tensors, MTP_FILE};
use tandem::model::{Batch, ModelError, MtpHead, OutputRows};
use tandem::tiny::{tiny_model_cpu, TinyPreset};

fn target() -> tandem::model::Model {
    tiny_model_cpu(TinyPreset::Test).unwrap().0
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2().unwrap()
}

#[test]
fn pairs_fed_in_chunks_equal_pairs_fed_at_once() {
    let model = target();
    let h = model.config().hidden_size;
    let n = 9;
    let hidden = (Tensor::arange(0f32, (n * h) as f32, &Device::Cpu)
        .unwrap()
        .reshape((n, h))
        .unwrap()
        * 0.01)
        .unwrap()
        .sin()
        .unwrap();
    let tokens: Vec<u32> = (0..n as u32).map(|i| 10 + 3 * i).collect();
    let slot: SlotId = 4;

    let mut once = MtpHead::random(&model, 1).unwrap();
    once.admit(slot, 64).unwrap();
    let mut b = Batch::default();
    b.push(slot, 0, &tokens, OutputRows::Last);
    let want = rows(&once.step(&model, &b, Some(&hidden)).unwrap());

    let mut chunked = MtpHead::random(&model, 1).unwrap();
    chunked.admit(slot, 64).unwrap();
    let mut got = Vec::new();
    for (a, z) in [(0, 4), (4, 5), (5, 9)] {
        let mut b = Batch::default();
        b.push(slot, a, &tokens[a..z], OutputRows::Last);
        got = rows(
            &chunked
                .step(&model, &b, Some(&hidden.narrow(0, a, z - a).unwrap()))
                .unwrap(),
        );
    }
    let diff = got[0]
        .iter()
        .zip(&want[0])
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(diff < 1e-4, "chunked pairs differ by {diff}");
    assert_eq!(chunked.len(slot).unwrap(), n);

    // A speculative round appends, truncate forgets it.
    let mut b = Batch::default();
    b.push(slot, n, &[7], OutputRows::Last);
    chunked.step(&model, &b, None).unwrap();
    assert_eq!(chunked.len(slot).unwrap(), n + 1);
    chunked.truncate(slot, n).unwrap();
    assert_eq!(chunked.len(slot).unwrap(), n);
}

#[test]
fn a_saved_head_loads_and_errors_name_the_tensor() {
    let model = target();
    let dir = std::env::temp_dir().join(format!("tandem-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tensors = random_tensors(model.config(), 3).unwrap();
    candle_core::safetensors::save(&tensors, dir.join(MTP_FILE)).unwrap();
    let mut loaded = MtpHead::from_dir(&model, &dir).unwrap();
    let mut direct = MtpHead::random(&model, 3).unwrap();
    let hidden = Tensor::ones(
        (2, model.config().hidden_size),
        candle_core::DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let mut b = Batch::default();
    b.push(1, 0, &[5, 6], OutputRows::Last);
    loaded.admit(1, 8).unwrap();
    direct.admit(1, 8).unwrap();
    assert_eq!(
        rows(&loaded.step(&model, &b, Some(&hidden)).unwrap()),
        rows(&direct.step(&model, &b, Some(&hidden)).unwrap())
    );

    assert_eq!(mtp_tensor_shapes(model.config()).len(), tensors.len());
    let mut missing: HashMap<String, Tensor> = tensors.clone();
    missing.remove("mtp.eh_proj.weight");
    let err = MtpHead::from_tensors(&model, missing, &dir.join(MTP_FILE))
        .err()
        .unwrap();
    assert!(
        matches!(err, ModelError::MissingTensor { ref name, .. } if name == "mtp.eh_proj.weight"),
        "{err}"
    );
    let mut wrong = tensors;
    wrong.insert(
        "mtp.hnorm.weight".into(),
        Tensor::ones(3, candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    let err = MtpHead::from_tensors(&model, wrong, &dir.join(MTP_FILE))
        .err()
        .unwrap();
    assert!(
        matches!(err, ModelError::ShapeMismatch { ref name, .. } if name == "mtp.hnorm.weight"),
        "{err}"
    );
    let err = MtpHead::from_dir(&model, &std::env::temp_dir().join("tandem-no-such-dir"))
        .err()
        .unwrap();
    assert!(err.to_string().contains("mtp.safetensors"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
