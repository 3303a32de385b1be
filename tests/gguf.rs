//! GGUF against real-model references: SmolLM2-135M-Instruct's Q4_1 GGUF
//! (`../shared/models/smollm2-135m-instruct`), loaded with f32 compute
//! (weights dequantised at load), must reproduce the float32 greedy ids of
//! `reference.json`, and its GGUF tokenizer and chat template must give the
//! reference prompt ids. Skips, saying so, when `../shared` is absent.

#[path = "server_support/mod.rs"]
mod server_support;
mod support;

use std::time::Instant;

use support::reference::{ids, shared, smollm2};
use tandem::gguf::writer::GgufWriter;
use tandem::gguf::{GgufFile, Value, ValueType};
use tandem::model::{LoadOptions, Model};
use tandem::server::chat_template::{ChatMessage, ChatTemplate};
use tandem::tokenizer::Tokenizer;

/// SmolLM2's `<|im_end|>`, where the reference stops.
const EOS: u32 = 2;

/// Greedy ids up to and including the first EOS (as the reference stops).
fn until_eos(ids: &[u32]) -> &[u32] {
    match ids.iter().position(|&t| t == EOS) {
        Some(i) => &ids[..=i],
        None => ids,
    }
}

#[test]
fn smollm2_q4_1_gguf_matches_the_f32_greedy_references() {
    let Some((path, prompts)) = smollm2() else {
        return;
    };
    let t0 = Instant::now();
    let file = GgufFile::open(&path).expect("open the GGUF");
    let parsed = t0.elapsed();
    let model = tandem::gguf::load_model(&file, &LoadOptions::default()).expect("load");
    eprintln!(
        "GGUF {}: parsed (memory-mapped) in {parsed:?}, model loaded (dequantised to f32) in {:?}",
        path.display(),
        t0.elapsed()
    );
    let cfg = model.config();
    assert_eq!(
        (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads),
        (30, 9, 3)
    );
    assert!(cfg.tie_word_embeddings);

    // One at a time.
    for p in &prompts {
        let t = Instant::now();
        let got = model
            .greedy(std::slice::from_ref(&p.prompt_ids), p.generated_ids.len())
            .expect("greedy");
        assert_eq!(
            until_eos(&got[0]),
            &p.generated_ids[..],
            "prompt `{}`, alone",
            p.name
        );
        eprintln!(
            "{}: {} ids match ({:?})",
            p.name,
            p.generated_ids.len(),
            t.elapsed()
        );
    }

    // All in one batch.
    let t = Instant::now();
    let all: Vec<Vec<u32>> = prompts.iter().map(|p| p.prompt_ids.clone()).collect();
    let steps = prompts.iter().map(|p| p.generated_ids.len()).max().unwrap();
    let got = model.greedy(&all, steps).expect("greedy");
    for (p, g) in prompts.iter().zip(&got) {
        let g = &g[..p.generated_ids.len()];
        assert_eq!(
            until_eos(g),
            &p.generated_ids[..],
            "prompt `{}`, batched",
            p.name
        );
    }
    eprintln!(
        "all {} prompts batched match ({:?})",
        prompts.len(),
        t.elapsed()
    );
}

#[test]
fn model_from_gguf_opens_the_file() {
    let Some((path, _)) = smollm2() else {
        return;
    };
    let t0 = Instant::now();
    let model = Model::from_gguf(&path, &LoadOptions::default()).expect("from_gguf");
    eprintln!("Model::from_gguf: {:?}", t0.elapsed());
    assert_eq!(model.config().vocab_size, 49152);
}

/// Deterministic test strings: runs of whitespace, code, digits, accents,
/// CJK, emoji, special tokens, mixed at random.
fn tokenizer_corpus(n: usize) -> Vec<String> {
    use rand::{Rng, SeedableRng};
    const PIECES: &[&str] = &[
        "hello",
        "Hello",
        " world",
        "the",
        " The",
        "don't",
        "it's",
        "I'M",
        "we'll",
        "you'd",
        " ",
        "  ",
        "   ",
        "        ",
        "\t",
        "\t\t",
        "\n",
        "\n\n",
        "\r\n",
        " \n ",
        "\u{a0}",
        "fn main() {\n    println!(\"hi\");\n}",
        "x = [1, 2, 3]",
        "def f(a, b):\n\treturn a+b",
        "<div class=\"a\">",
        "// comment",
        "#include <stdio.h>",
        "a_b-c.d/e",
        "https://example.com/a?b=1&c=2",
        "0",
        "7",
        "42",
        "2024",
        "3.14159",
        "1,000,000",
        "-12e5",
        "0x1F",
        "café",
        "naïve",
        "Ünïcödé",
        "façade",
        "Straße",
        "ñandú",
        "Ελληνικά",
        "русский",
        "日本語",
        "中文字符",
        "한국어",
        "ไทย",
        "عربى",
        "עברית",
        "👍",
        "👍🏽",
        "🤗",
        "👨‍👩‍👧",
        "🇫🇷",
        "✨",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<file_sep>",
        "<repo_name>",
        "<|im_start|>user\n",
        "!",
        "?!",
        "...",
        "—",
        "«»",
        "(",
        ")",
        "{",
        "}",
        "$",
        "%",
        "&&",
        "||",
        "::",
        "->",
        "=>",
    ];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
    let mut out: Vec<String> = PIECES.iter().map(|s| s.to_string()).collect();
    while out.len() < n {
        let mut s = String::new();
        for _ in 0..rng.random_range(1..12) {
            if rng.random_range(0..8) == 0 {
                // A random code point from a few blocks (ASCII to astral).
                let c = match rng.random_range(0..4) {
                    0 => rng.random_range(0x20..0x7f),
                    1 => rng.random_range(0xa0..0x800),
                    2 => rng.random_range(0x3000..0xa000),
                    _ => rng.random_range(0x1f300..0x1fa00),
                };
                s.extend(char::from_u32(c));
            } else {
                s.push_str(PIECES[rng.random_range(0..PIECES.len())]);
            }
        }
        out.push(s);
    }
    out
}

#[test]
fn smollm2_gguf_tokenizer_equals_its_tokenizer_json() {
    let Some((path, _)) = smollm2() else {
        return;
    };
    let t0 = Instant::now();
    let gguf = Tokenizer::from_gguf_path(&path).expect("tokenizer from GGUF");
    eprintln!("tokenizer from GGUF metadata: {:?}", t0.elapsed());
    let hf = Tokenizer::from_dir(path.parent().unwrap()).expect("tokenizer.json");
    assert_eq!(gguf.vocab_size(), hf.vocab_size());
    assert_eq!(gguf.bos_id(), hf.bos_id());
    assert_eq!(gguf.eos_ids(), hf.eos_ids());
    assert_eq!(gguf.chat_template(), hf.chat_template());
    let corpus = tokenizer_corpus(3000);
    for text in &corpus {
        let ids = hf.encode(text).unwrap();
        assert_eq!(gguf.encode(text).unwrap(), ids, "encode {text:?}");
        assert_eq!(
            gguf.encode_plain(text).unwrap(),
            hf.encode_plain(text).unwrap(),
            "encode_plain {text:?}"
        );
        assert_eq!(
            gguf.decode(&ids).unwrap(),
            hf.decode(&ids).unwrap(),
            "decode {text:?}"
        );
        let (g, h) = (gguf.inner(), hf.inner());
        assert_eq!(
            g.decode(&ids, false).unwrap(),
            h.decode(&ids, false).unwrap(),
            "decode with specials {text:?}"
        );
    }
    eprintln!("{} strings tokenize identically", corpus.len());
}

#[test]
fn smollm2_gguf_chat_template_renders_the_reference_prompt_ids() {
    let Some((path, prompts)) = smollm2() else {
        return;
    };
    let tokenizer = Tokenizer::from_gguf_path(&path).expect("tokenizer from GGUF");
    let template = ChatTemplate::from_tokenizer(&tokenizer).expect("template compiles");
    assert!(
        template.has_template(),
        "the GGUF has tokenizer.chat_template"
    );
    let mut chats = 0;
    for p in &prompts {
        let text = if p.kind == "chat" {
            chats += 1;
            let messages: Vec<ChatMessage> = p
                .messages
                .iter()
                .map(|(role, content)| ChatMessage {
                    role: role.clone(),
                    content: content.clone(),
                    ..ChatMessage::default()
                })
                .collect();
            let rendered = template.render(&messages, true).expect("render");
            assert_eq!(rendered, p.text, "rendered `{}`", p.name);
            rendered
        } else {
            p.text.clone()
        };
        assert_eq!(
            tokenizer.encode(&text).unwrap(),
            p.prompt_ids,
            "prompt ids of `{}`",
            p.name
        );
    }
    assert_eq!(chats, 3);
}

/// A GGUF holding only stories260k's tokenizer as llama.cpp writes a
/// SentencePiece (`llama`) vocabulary: pieces in id order, scores `-id` for
/// normal pieces (SentencePiece BPE scores a piece by its merge rank), 0 for
/// the unknown, control and byte tokens.
fn stories260k_tokenizer_gguf(dir: &std::path::Path) -> GgufFile {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let mut pieces: Vec<(u64, &str)> = vocab
        .iter()
        .map(|(t, i)| (i.as_u64().unwrap(), t.as_str()))
        .collect();
    pieces.sort();
    let kind = |id: u64, t: &str| match (id, t) {
        (0, _) => 2,
        (1 | 2, _) => 3,
        (_, t) if t.starts_with("<0x") => 6,
        _ => 1,
    };
    let strings = |v: Vec<String>| {
        Value::Array(
            ValueType::String,
            v.into_iter().map(Value::String).collect(),
        )
    };
    let mut w = GgufWriter::new();
    w.kv("general.architecture", Value::String("llama".into()))
        .kv("tokenizer.ggml.model", Value::String("llama".into()))
        .kv(
            "tokenizer.ggml.tokens",
            strings(pieces.iter().map(|p| p.1.to_string()).collect()),
        )
        .kv(
            "tokenizer.ggml.scores",
            Value::Array(
                ValueType::F32,
                pieces
                    .iter()
                    .map(|&(i, t)| Value::F32(if kind(i, t) == 1 { -(i as f32) } else { 0.0 }))
                    .collect(),
            ),
        )
        .kv(
            "tokenizer.ggml.token_type",
            Value::Array(
                ValueType::I32,
                pieces
                    .iter()
                    .map(|&(i, t)| Value::I32(kind(i, t)))
                    .collect(),
            ),
        )
        .kv("tokenizer.ggml.bos_token_id", Value::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Value::U32(2))
        .kv("tokenizer.ggml.unknown_token_id", Value::U32(0));
    GgufFile::from_bytes(w.to_bytes()).expect("a valid GGUF")
}

#[test]
fn spm_gguf_tokenizer_equals_stories260k_tokenizer_json() {
    let Some(dir) = shared("models/stories260k") else {
        return;
    };
    let gguf = Tokenizer::from_gguf(&stories260k_tokenizer_gguf(&dir)).expect("SPM tokenizer");
    let hf = Tokenizer::from_dir(&dir).expect("tokenizer.json");
    assert_eq!(gguf.vocab_size(), hf.vocab_size());
    assert_eq!((gguf.bos_id(), gguf.eos_ids()), (hf.bos_id(), hf.eos_ids()));
    let corpus = tokenizer_corpus(3000);
    for text in corpus.iter().map(|s| {
        s.replace("<|im_start|>", "<s>")
            .replace("<|im_end|>", "</s>")
    }) {
        let ids = hf.encode(&text).unwrap();
        assert_eq!(gguf.encode(&text).unwrap(), ids, "encode {text:?}");
        assert_eq!(
            gguf.encode_plain(&text).unwrap(),
            hf.encode_plain(&text).unwrap(),
            "encode_plain {text:?}"
        );
        assert_eq!(
            gguf.decode(&ids).unwrap(),
            hf.decode(&ids).unwrap(),
            "decode {text:?}"
        );
    }
    // The reference prompts too.
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    for p in reference["prompts"].as_array().unwrap() {
        let text = p["text"].as_str().unwrap();
        assert_eq!(
            gguf.encode(text).unwrap(),
            ids(&p["prompt_ids"]),
            "prompt {text:?}"
        );
    }
}

/// Corrupted copies of the real file fail with typed errors naming what is
/// wrong, at parse time or when the model is built; none panics.
#[test]
fn corrupted_copies_of_the_smollm2_gguf_are_typed_errors() {
    use tandem::gguf::GgufError;
    let Some((path, _)) = smollm2() else {
        return;
    };
    let bytes = std::fs::read(&path).unwrap();
    let parse = |b: Vec<u8>| GgufFile::from_bytes(b);
    let poke = |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    let find = |needle: &[u8]| {
        bytes
            .windows(needle.len())
            .position(|w| w == needle)
            .unwrap()
    };

    let mut b = bytes[..4096].to_vec();
    b[..4].copy_from_slice(b"GGML");
    assert!(matches!(parse(b), Err(GgufError::BadMagic { .. })));

    // Truncated: in the header, the token list, the merges, the tensor
    // infos, and the tensor data (first tensor, middle, last byte).
    let infos = find(b"\x11\0\0\0\0\0\0\0token_embd.weight");
    for len in [
        3,
        20,
        1000,
        600_000,
        1_500_000,
        infos + 10,
        infos + 5000,
        5_000_000,
        60_000_000,
        bytes.len() - 1,
    ] {
        let e = parse(bytes[..len].to_vec())
            .err()
            .unwrap_or_else(|| panic!("truncated at {len} parsed"));
        assert!(
            matches!(e, GgufError::Truncated { .. } | GgufError::Limit { .. }),
            "at {len}: {e}"
        );
        eprintln!("truncated at {len}: {e}");
    }

    // Tensor count one too many: the data is read as a tensor info.
    let mut b = bytes.clone();
    poke(&mut b, 8, 273);
    let e = parse(b).unwrap_err();
    eprintln!("273 tensors: {e}");
    // One too few: the last tensor is missing when the model is built.
    let mut b = bytes.clone();
    poke(&mut b, 8, 271);
    let file = parse(b).unwrap();
    let last = GgufFile::open(&path)
        .unwrap()
        .tensors()
        .last()
        .unwrap()
        .name
        .clone();
    let e = tandem::gguf::load_model(&file, &LoadOptions::default())
        .err()
        .unwrap();
    assert!(
        matches!(&e, GgufError::MissingTensor(n) if *n == last),
        "{e}"
    );

    // Absurd dimensions of token_embd.weight (its first dim follows the
    // name and the dimension count).
    let dim0 = infos + 8 + 17 + 4;
    let mut b = bytes.clone();
    poke(&mut b, dim0, 1 << 62);
    let e = parse(b).unwrap_err().to_string();
    assert!(
        e.contains("token_embd.weight") && e.contains("dimension"),
        "{e}"
    );
    let mut b = bytes.clone();
    poke(&mut b, dim0 + 8, 1 << 36);
    let e = parse(b).unwrap_err().to_string();
    assert!(e.contains("token_embd.weight"), "{e}");
    // An unknown type id.
    let mut b = bytes.clone();
    b[dim0 + 16..dim0 + 20].copy_from_slice(&77u32.to_le_bytes());
    let e = parse(b).unwrap_err().to_string();
    assert!(
        e.contains("token_embd.weight") && e.contains("unknown GGML type 77"),
        "{e}"
    );
}

/// `--model FILE.gguf`: the server's loader takes model, tokenizer and chat
/// template from the file.
#[test]
fn server_load_accepts_a_gguf_file() {
    use tandem::server::load::{load, LoadSpec, ModelSource};
    let Some((path, prompts)) = smollm2() else {
        return;
    };
    let spec = LoadSpec {
        source: ModelSource::Dir(path),
        dtype: candle_core::DType::F32,
        device: candle_core::Device::Cpu,
        kv_tokens: 4096,
        kv_block_size: tandem::kv::DEFAULT_BLOCK_SIZE,
        weight_format: tandem::model::WeightFormat::AsCompute,
        activation_quant: Default::default(),
        kv_dtype: None,
        mtp: Default::default(),
        draft_max: 4,
        prompt_lookup: false,
    };
    let loaded = load(&spec).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(loaded.model_name, "SmolLM2-135M-Instruct.Q4_1");
    assert!(loaded.template.has_template());
    assert_eq!(loaded.tokenizer.eos_ids(), [EOS]);
    let chat = prompts.iter().find(|p| p.kind == "chat").unwrap();
    assert_eq!(
        loaded.tokenizer.encode(&chat.text).unwrap(),
        chat.prompt_ids
    );

    // A file that is not GGUF says so.
    let dir = std::env::temp_dir().join(format!("tandem-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bogus = dir.join("bogus.gguf");
    std::fs::write(&bogus, b"not a model").unwrap();
    let spec = LoadSpec {
        source: ModelSource::Dir(bogus),
        ..spec
    };
    let e = load(&spec).err().expect("a bogus file fails").to_string();
    assert!(e.contains("not a GGUF file"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `tandem serve --model FILE.gguf`: `/v1/chat/completions` renders the
/// GGUF's chat template and reproduces the reference replies over HTTP;
/// `/v1/completions` the plain ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_the_gguf_with_reference_replies() {
    use serde_json::{json, Value};
    use server_support::{post_json, BinaryServer};
    let Some((path, _)) = smollm2() else {
        return;
    };
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(path.with_file_name("reference.json")).unwrap(),
    )
    .unwrap();
    // f32 compute (the file's weights dequantised): the references are float32's.
    let server = BinaryServer::spawn(&[
        "--model",
        path.to_str().unwrap(),
        "--dtype",
        "f32",
        "--kv-tokens",
        "8192",
    ]);
    let c = reqwest::Client::new();
    let models: Value = c
        .get(server.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    // `root`: the model's own name, from the GGUF metadata.
    let file = tandem::gguf::GgufFile::open(&path).unwrap();
    let general_name = file.opt_str("general.name").unwrap().unwrap().to_string();
    assert_eq!(models["data"][0]["root"], general_name.as_str());
    // The second pass runs with the prefix cache warm: every prompt of a
    // full block or more starts after its cached blocks, same replies.
    for pass in 0..2 {
        for case in reference["prompts"].as_array().unwrap() {
            let n = case["generated_ids"].as_array().unwrap().len();
            let (route, body, field) = if case["kind"] == "chat" {
                (
                    "/v1/chat/completions",
                    json!({"messages": case["messages"], "max_tokens": n, "temperature": 0}),
                    "/message/content",
                )
            } else {
                (
                    "/v1/completions",
                    json!({"prompt": case["text"], "max_tokens": n, "temperature": 0}),
                    "/text",
                )
            };
            let (status, v) = post_json(&c, &server.url(route), &body).await;
            assert_eq!(status, 200, "{v}");
            let choice = &v["choices"][0];
            assert_eq!(
                choice.pointer(field).and_then(Value::as_str),
                case["generated_text"].as_str(),
                "{}",
                case["name"]
            );
            assert_eq!(
                v["usage"]["prompt_tokens"],
                case["prompt_ids"].as_array().unwrap().len(),
                "{}",
                case["name"]
            );
            let reason = if case["stopped_at_eos"] == true {
                "stop"
            } else {
                "length"
            };
            assert_eq!(choice["finish_reason"], reason, "{}", case["name"]);
            let prompt_len = case["prompt_ids"].as_array().unwrap().len();
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap() as usize;
            if pass == 1 {
                let blocks = (prompt_len - 1) / tandem::kv::DEFAULT_BLOCK_SIZE;
                assert_eq!(
                    cached,
                    blocks * tandem::kv::DEFAULT_BLOCK_SIZE,
                    "{}",
                    case["name"]
                );
            }
        }
    }
}
