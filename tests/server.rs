//! End-to-end tests of the HTTP server: a live server on `127.0.0.1:0`
//! serving the embedded Test model, driven with reqwest, and compared with
//! direct library calls on the same scheduler.
//!
//! This file: generation (completions, chat, logprobs, stop strings, seeds,
//! 32 concurrent clients, templates). `limits`: errors, auth, 429/503,
//! disconnects, metrics, shutdown. `hardening`: what a hostile test found
//! (issue #20). `choices`: `n` and `best_of`. `grammar`: structured
//! output, tool calls, logit bias, stop ids (issue #19). `soak`: a bounded
//! soak with cancellations, malformed
//! requests and overload. `binary`: the real `tandem` binary, the
//! official `openai` Python client and a real checkpoint.

mod server_support;

#[path = "server_support/binary.rs"]
mod binary;
#[path = "server_support/choices.rs"]
mod choices;
#[path = "server_support/grammar.rs"]
mod grammar;
#[path = "server_support/hardening.rs"]
mod hardening;
#[path = "server_support/limits.rs"]
mod limits;
#[path = "server_support/soak.rs"]
mod soak;

use std::time::Duration;

use futures_util::future::join_all;
use serde_json::{json, Value};
use server_support::*;
use tandem::api::{GenerateRequest, Prompt};
use tandem::sampler::SamplingOptions;
use tandem::scheduler::SchedulerConfig;
use tandem::server::{HttpConfig, ShutdownOutcome};

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// The library's greedy completion of `prompt` (the reference for HTTP).
async fn library_text(s: &TestServer, prompt: &str, max_tokens: usize) -> (String, usize) {
    let done = s
        .handle()
        .complete(GenerateRequest::new(prompt, max_tokens))
        .await
        .expect("library completion");
    (done.text, done.finished.usage.prompt_tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_whole_and_streamed_match_the_library() {
    let s = TestServer::ready();
    let c = client();
    let (expected, prompt_tokens) = library_text(&s, "the quick brown fox", 12).await;
    assert!(!expected.is_empty());
    let body =
        json!({"model": "x", "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0});
    let (status, v) = post_json(&c, &s.url("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "tandem-tiny-test");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["choices"][0]["text"], expected.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["choices"][0]["logprobs"].is_null());
    assert_eq!(
        v["usage"],
        json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 12,
            "total_tokens": prompt_tokens + 12,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
        })
    );

    // Streamed, without usage: no `usage` key at all, and the same text.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let chunks = sse_chunks(&post_stream(&c, &s.url("/v1/completions"), &stream_body).await);
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(text, expected);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));

    // With include_usage: `usage: null` on every chunk but a last one with
    // empty choices and the counts.
    stream_body["stream_options"] = json!({"include_usage": true});
    let chunks = sse_chunks(&post_stream(&c, &s.url("/v1/completions"), &stream_body).await);
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 12);
    assert_eq!(usage_chunk["usage"]["prompt_tokens"], prompt_tokens);
    assert!(rest
        .iter()
        .all(|c| c["usage"].is_null() && c.get("usage").is_some()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_whole_and_streamed_use_the_plain_template() {
    let s = TestServer::ready();
    let c = client();
    // The embedded model has no chat template: the documented fallback.
    let (expected, prompt_tokens) = library_text(
        &s,
        "System: be brief\n\nUser: hello there\n\nAssistant:",
        10,
    )
    .await;
    let body = json!({
        "model": "tandem-tiny-test",
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
        "max_completion_tokens": 10, "temperature": 0,
    });
    let (status, v) = post_json(&c, &s.url("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], expected.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 10);
    assert_eq!(v["usage"]["total_tokens"], prompt_tokens + 10);

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let chunks = sse_chunks(&post_stream(&c, &s.url("/v1/chat/completions"), &stream_body).await);
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|ch| ch["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, expected);
    let n = chunks.len();
    assert_eq!(chunks[n - 2]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[n - 2]["choices"][0]["delta"], json!({}));
    assert_eq!(chunks[n - 1]["usage"]["completion_tokens"], 10);
}

/// Logprobs of both routes have OpenAI's shapes and the values the library
/// reports for the same request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_have_openai_shapes_and_library_values() {
    let s = TestServer::ready();
    let c = client();
    let prompt = "once upon a time";
    let sampling = SamplingOptions {
        logprobs: true,
        top_logprobs: 3,
        ..SamplingOptions::greedy()
    };
    let lib = s
        .handle()
        .complete(GenerateRequest::new(prompt, 8).with_sampling(sampling))
        .await
        .unwrap();
    let tok = s.handle().tokenizer().clone();

    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3});
    let (status, v) = post_json(&c, &s.url("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let n = lib.tokens.len();
    assert_eq!(n, 8);
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().unwrap().len(), n, "{key}");
    }
    let mut last_offset = 0;
    for (i, t) in lib.tokens.iter().enumerate() {
        assert_eq!(lp["tokens"][i], tok.token_text(t.id).unwrap().as_str());
        assert_eq!(
            lp["token_logprobs"][i].as_f64().unwrap() as f32,
            t.logprob.unwrap()
        );
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(top.len(), 3);
        for alt in &t.top_logprobs {
            assert_eq!(top[&alt.text].as_f64().unwrap() as f32, alt.logprob);
        }
        let off = lp["text_offset"][i].as_u64().unwrap();
        assert!(off >= last_offset, "text_offset is non-decreasing");
        last_offset = off;
    }

    let body = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                      "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (status, v) = post_json(&c, &s.url("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    let lib = s
        .handle()
        .complete(
            GenerateRequest::new(format!("User: {prompt}\n\nAssistant:"), 8).with_sampling(
                SamplingOptions {
                    top_logprobs: 2,
                    ..sampling
                },
            ),
        )
        .await
        .unwrap();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), lib.tokens.len());
    for (entry, t) in content.iter().zip(&lib.tokens) {
        let text = tok.token_text(t.id).unwrap();
        assert_eq!(entry["token"], text.as_str());
        assert_eq!(
            entry["logprob"].as_f64().unwrap() as f32,
            t.logprob.unwrap()
        );
        let bytes: Vec<u8> = serde_json::from_value(entry["bytes"].clone()).unwrap();
        assert_eq!(bytes, text.as_bytes());
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        for (a, b) in top.iter().zip(&t.top_logprobs) {
            assert_eq!(a["token"], b.text.as_str());
            assert_eq!(a["logprob"].as_f64().unwrap() as f32, b.logprob);
            assert!(a["bytes"].is_array());
        }
    }
    // The greedy token is the most likely one.
    assert_eq!(content[0]["top_logprobs"][0]["token"], content[0]["token"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_end_the_text_with_finish_reason_stop() {
    let s = TestServer::ready();
    let c = client();
    let (full, _) = library_text(&s, "a b c", 16).await;
    let words: Vec<&str> = full.split(' ').collect();
    assert!(words.len() > 4, "{full}");
    let stop = format!(" {}", words[3]);
    let cut = full.find(&stop).unwrap();
    for stream in [false, true] {
        let body = json!({"prompt": "a b c", "max_tokens": 16, "temperature": 0,
                          "stop": [stop.clone(), "zzzz-never"], "stream": stream});
        let (text, reason) = if stream {
            let chunks = sse_chunks(&post_stream(&c, &s.url("/v1/completions"), &body).await);
            let text: String = chunks
                .iter()
                .map(|c| c["choices"][0]["text"].as_str().unwrap_or(""))
                .collect();
            (
                text,
                chunks.last().unwrap()["choices"][0]["finish_reason"].clone(),
            )
        } else {
            let (status, v) = post_json(&c, &s.url("/v1/completions"), &body).await;
            assert_eq!(status, 200, "{v}");
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                v["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(text, full[..cut], "stream={stream}");
        assert_eq!(reason, "stop");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeds_reproduce_sampled_text() {
    let s = TestServer::ready();
    let c = client();
    let run = |seed: u64| {
        let body = json!({"prompt": "tell me", "max_tokens": 16, "temperature": 1.0,
                          "top_p": 0.95, "seed": seed});
        let (c, url) = (c.clone(), s.url("/v1/completions"));
        async move {
            let (status, v) = post_json(&c, &url, &body).await;
            assert_eq!(status, 200, "{v}");
            v["choices"][0]["text"].as_str().unwrap().to_string()
        }
    };
    let a = run(42).await;
    assert_eq!(run(42).await, a, "same seed, same text");
    let others = join_all([run(1), run(2), run(3)]).await;
    assert!(
        others.iter().any(|o| *o != a),
        "different seeds should differ"
    );
}

/// 32 streaming clients at once; each gets exactly the text it gets alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_streams_match_solo_runs() {
    let s = TestServer::ready();
    let c = client();
    let words = [
        "red", "blue", "green", "stone", "river", "cloud", "seven", "light",
    ];
    let prompts: Vec<String> = (0..32)
        .map(|i| {
            format!(
                "{} {} {}",
                words[i % 8],
                words[(i / 8) % 8],
                words[(i * 3) % 8]
            )
        })
        .collect();
    let mut solo = Vec::new();
    for p in &prompts {
        solo.push(library_text(&s, p, 20).await.0);
    }
    let before = s.metrics(&c).await;
    let runs = prompts.iter().map(|p| {
        let body = json!({"prompt": p, "max_tokens": 20, "temperature": 0, "stream": true});
        let (c, url) = (c.clone(), s.url("/v1/completions"));
        async move {
            let chunks = sse_chunks(&post_stream(&c, &url, &body).await);
            assert_eq!(
                chunks.last().unwrap()["choices"][0]["finish_reason"],
                "length"
            );
            chunks
                .iter()
                .map(|c| c["choices"][0]["text"].as_str().unwrap_or("").to_string())
                .collect::<String>()
        }
    });
    let texts = join_all(runs).await;
    for (i, (t, e)) in texts.iter().zip(&solo).enumerate() {
        assert_eq!(t, e, "client {i}");
    }
    let after = s.metrics(&c).await;
    assert_eq!(after.outcome("finished") - before.outcome("finished"), 32.0);
    // The requests shared forward passes.
    assert!(
        after.get("tandem_steps_total") - before.get("tandem_steps_total") < 32.0 * 20.0 / 2.0,
        "batched steps"
    );
}

/// A model with a chat template: the prompt is the rendered template
/// (with `bos_token`, Python string methods and `raise_exception`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_renders_the_models_template() {
    let template = "{{ bos_token }}{% for m in messages %}\
        {% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}\
        {{ m['role'] | upper }}: {{ m['content'].strip() }}{{ eos_token }}\n{% endfor %}\
        {% if add_generation_prompt %}ASSISTANT:{% endif %}";
    let s = TestServer::start(Options {
        chat_template: Some(template.into()),
        ..Options::default()
    });
    let c = client();
    let (expected, prompt_tokens) =
        library_text(&s, "<s>USER: bright morning</s>\nASSISTANT:", 8).await;
    let body = json!({"messages": [{"role": "user", "content": "  bright morning "}],
                      "max_tokens": 8, "temperature": 0});
    let (status, v) = post_json(&c, &s.url("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], expected.as_str());
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    let body = json!({"messages": [{"role": "tool", "content": "x"}]});
    let (status, v) = post_json(&c, &s.url("/v1/chat/completions"), &body).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "messages");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("tool messages are not supported"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_as_token_ids_matches_the_library() {
    let s = TestServer::ready();
    let c = client();
    let ids = vec![1u32, 20, 30, 40];
    let lib = s
        .handle()
        .complete(GenerateRequest {
            prompt: Prompt::Tokens(ids.clone()),
            ..GenerateRequest::new("", 6)
        })
        .await
        .unwrap();
    let (status, v) = post_json(
        &c,
        &s.url("/v1/completions"),
        &json!({"prompt": [ids], "max_tokens": 6, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], lib.text.as_str());
    assert_eq!(v["usage"]["prompt_tokens"], 4);
}
