//! End-to-end tests of the HTTP server: a live server on `127.0.0.1:0`
//! serving the embedded Test model, driven with reqwest, and compared with
//! direct library calls on the same scheduler.

mod server_support;

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
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": 12, "total_tokens": prompt_tokens + 12})
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnecting_client_frees_its_slot() {
    let s = TestServer::ready();
    let c = client();
    let body = json!({"prompt": "go on", "max_tokens": 1000, "temperature": 0, "stream": true});
    let mut r = c
        .post(s.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().expect("a first chunk");
    assert!(first.starts_with(b"data: "));
    let m = s.metrics(&c).await;
    assert_eq!(m.get("tandem_running_sequences"), 1.0, "generating");
    drop(r);
    let m = s
        .wait_metrics(&c, Duration::from_secs(5), |m| {
            m.get("tandem_running_sequences") == 0.0 && m.get("tandem_releasing_sequences") == 0.0
        })
        .await;
    assert_eq!(m.get("tandem_running_sequences"), 0.0);
    assert_eq!(m.get("tandem_free_slots"), m.get("tandem_max_sequences"));
    assert_eq!(m.outcome("cancelled"), 1.0, "cancelled, not finished");
    assert_eq!(m.outcome("finished"), 0.0);
    assert!(m.get("tandem_generated_tokens_total") < 1000.0);
}

/// Every bad-input class gets its status and names its field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_their_status_and_name_the_field() {
    let s = TestServer::start(Options {
        http: HttpConfig {
            body_limit: 64 * 1024,
            ..HttpConfig::default()
        },
        ..Options::default()
    });
    let c = client();
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let long_prompt: Vec<u32> = vec![5; TEST_CONTEXT + 10];
    let cases: Vec<(&str, Value, u16, Option<&str>)> = vec![
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": "hot"}),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 1.5}),
            400,
            Some("top_p"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 2}),
            400,
            Some("n"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 5000}),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": true}),
            400,
            Some("logprobs"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 21}),
            400,
            Some("logprobs"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": [1]}),
            400,
            Some("stop[0]"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "seed": "s"}),
            400,
            Some("seed"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_k": -5}),
            400,
            Some("top_k"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "repetition_penalty": -1}),
            400,
            Some("repetition_penalty"),
        ),
        (
            "/v1/completions",
            json!({"prompt": long_prompt}),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 99999]}),
            400,
            Some("prompt[1]"),
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 3}),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "tandem": {"mtp": "head:/m"}}),
            400,
            Some("tandem.mtp"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "echo": true}),
            400,
            Some("echo"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m"}),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "bot", "content": "x"}]}),
            400,
            Some("messages[0].role"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_logprobs": 3})),
            400,
            Some("top_logprobs"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 25})),
            400,
            Some("top_logprobs"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stream_options": {"include_usage": "yes"}})),
            400,
            Some("stream_options.include_usage"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"presence_penalty": 2.5})),
            400,
            Some("presence_penalty"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function"}]})),
            400,
            Some("tools"),
        ),
    ];
    for (path, body, status, param) in cases {
        let (got, v) = post_json(&c, &s.url(path), &body).await;
        assert_eq!(got, status, "{path} {body}: {v}");
        let err = &v["error"];
        assert_eq!(err["param"].as_str(), param, "{body}: {v}");
        let message = err["message"].as_str().unwrap();
        if let Some(p) = param {
            let root = p.split(['[', '.']).next().unwrap();
            assert!(message.contains(root), "message names {root}: {message}");
        }
        assert_eq!(err["type"], "invalid_request_error");
        assert!(err["code"].is_string());
    }

    // Malformed JSON and a non-object body.
    for raw in ["{\"prompt\": ", "[1, 2]", ""] {
        let r = c
            .post(s.url("/v1/completions"))
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{raw:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_json");
    }

    // Over the body limit: 413, whether announced by Content-Length or not.
    let big = json!({"prompt": "x".repeat(100 * 1024)});
    let (got, v) = post_json(&c, &s.url("/v1/completions"), &big).await;
    assert_eq!(got, 413, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("65536"));
    let chunked = reqwest::Body::wrap_stream(futures_util::stream::iter(
        (0..40).map(|_| Ok::<_, std::io::Error>(vec![b' '; 4096])),
    ));
    let r = c
        .post(s.url("/v1/completions"))
        .body(chunked)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);

    // Unknown route: a JSON 404.
    let r = c.get(s.url("/v1/nothing")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_429() {
    let s = TestServer::start(Options {
        sched: SchedulerConfig {
            max_seqs: 1,
            max_queue: 1,
            step_token_budget: 64,
            max_prefill_chunk: 32,
        },
        ..Options::default()
    });
    let c = client();
    let long = json!({"prompt": "busy", "max_tokens": 1000, "temperature": 0, "stream": true});
    // One running, one queued …
    let mut running = c
        .post(s.url("/v1/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert!(running.chunk().await.unwrap().is_some());
    let queued = c
        .post(s.url("/v1/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(queued.status(), 200);
    // … and the next is refused at once.
    let (status, v) = post_json(&c, &s.url("/v1/completions"), &json!({"prompt": "x"})).await;
    assert_eq!(status, 429, "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(v["error"]["code"], "overloaded");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_queue"));
    drop((running, queued));
    let m = s
        .wait_metrics(&c, Duration::from_secs(5), |m| {
            m.get("tandem_running_sequences") == 0.0 && m.get("tandem_queue_depth") == 0.0
        })
        .await;
    assert_eq!(m.get("tandem_queue_depth"), 0.0);
    assert_eq!(m.outcome("rejected"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loading_and_shutting_down_are_503() {
    let s = TestServer::start(Options {
        ready: false,
        ..Options::default()
    });
    let c = client();
    let r = c.get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "loading");
    let (status, v) = post_json(&c, &s.url("/v1/completions"), &json!({"prompt": "x"})).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (503, Some("model_loading"))
    );
    let m = s.metrics(&c).await;
    assert_eq!(m.get("tandem_ready"), 0.0);
    s.state.begin_shutdown();
    let r = c.get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "shutting_down");
    let (status, v) = post_json(&c, &s.url("/v1/chat/completions"), &json!({})).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (503, Some("shutting_down"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_enforced() {
    let s = TestServer::start(Options {
        http: HttpConfig {
            api_key: Some("sekret".into()),
            ..HttpConfig::default()
        },
        ..Options::default()
    });
    let c = client();
    let body = json!({"prompt": "x", "max_tokens": 2});
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("sekret"),
        Some("Bearer sekret2"),
    ] {
        let mut req = c.post(s.url("/v1/completions")).json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401, "{auth:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert_eq!(v["error"]["type"], "authentication_error");
    }
    let r = c.get(s.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .post(s.url("/v1/completions"))
        .bearer_auth("sekret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .get(s.url("/v1/models"))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tandem-tiny-test");
    assert_eq!(v["data"][0]["max_model_len"], TEST_CONTEXT);
    // Probes need no key.
    assert_eq!(c.get(s.url("/health")).send().await.unwrap().status(), 200);
    assert_eq!(c.get(s.url("/metrics")).send().await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_counters_move() {
    let s = TestServer::ready();
    let c = client();
    let before = s.metrics(&c).await;
    for name in [
        "tandem_queue_depth",
        "tandem_running_sequences",
        "tandem_generated_tokens_total",
        "tandem_steps_total",
        "tandem_mtp_drafted_tokens_total",
        "tandem_mtp_accepted_tokens_total",
    ] {
        assert!(before.docs.contains_key(name), "{name} documented");
        assert_eq!(before.get(name), 0.0, "{name} starts at 0");
    }
    assert_eq!(before.get("tandem_ready"), 1.0);
    let body = json!({"prompt": "count me", "max_tokens": 7, "temperature": 0});
    let (status, _) = post_json(&c, &s.url("/v1/completions"), &body).await;
    assert_eq!(status, 200);
    let body = json!({"messages": [{"role": "user", "content": "and me"}], "max_tokens": 5,
                      "temperature": 0.7, "seed": 3, "stream": true});
    post_stream(&c, &s.url("/v1/chat/completions"), &body).await;
    let after = s.metrics(&c).await;
    assert_eq!(after.get("tandem_generated_tokens_total"), 12.0);
    assert_eq!(after.outcome("finished"), 2.0);
    assert!(after.get("tandem_steps_total") >= 7.0);
    assert!(after.get("tandem_prompt_tokens_total") > 0.0);
    let sampler = after
        .value("tandem_sampler_calls_total", &[("path", "uniform")])
        .unwrap()
        + after
            .value("tandem_sampler_calls_total", &[("path", "serial")])
            .unwrap();
    assert!(sampler >= 7.0, "one sampler call per step");
    assert_eq!(
        after.histogram_count("tandem_time_to_first_token_seconds"),
        2
    );
    assert!(after.histogram_count("tandem_batch_size") >= 7);
    assert!(after.histogram_count("tandem_inter_token_latency_seconds") > 0);
    let ok = |route| {
        after.value(
            "tandem_http_responses_total",
            &[("route", route), ("code", "200")],
        )
    };
    assert_eq!(ok("completions"), Some(1.0));
    assert_eq!(ok("chat_completions"), Some(1.0));
}

/// Shutdown lets short requests finish and cancels what outlives the drain
/// timeout (`finish_reason: "abort"`); afterwards requests get 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_then_aborts() {
    let s = TestServer::ready();
    let c = client();
    let long = json!({"prompt": "long", "max_tokens": 1000, "temperature": 0, "stream": true});
    let mut r = c
        .post(s.url("/v1/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert!(r.chunk().await.unwrap().is_some());
    let reader = tokio::spawn(async move {
        let mut rest = String::new();
        while let Ok(Some(bytes)) = r.chunk().await {
            rest.push_str(&String::from_utf8_lossy(&bytes));
        }
        rest
    });
    let outcome = s.shutdown(Duration::from_millis(1)).await;
    assert_eq!(outcome, ShutdownOutcome::Aborted);
    let rest = reader.await.unwrap();
    assert!(rest.contains("\"finish_reason\":\"abort\""), "{rest}");
    assert!(rest.ends_with("data: [DONE]\n\n"));
    assert_eq!(s.state.phase_name(), "shutting_down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_short_requests() {
    let s = TestServer::ready();
    let c = client();
    let body = json!({"prompt": "short", "max_tokens": 50, "temperature": 0, "stream": true});
    let mut r = c
        .post(s.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(r.chunk().await.unwrap().is_some());
    let reader = tokio::spawn(async move {
        let mut rest = String::new();
        while let Ok(Some(bytes)) = r.chunk().await {
            rest.push_str(&String::from_utf8_lossy(&bytes));
        }
        rest
    });
    assert_eq!(
        s.shutdown(Duration::from_secs(20)).await,
        ShutdownOutcome::Drained
    );
    let rest = reader.await.unwrap();
    assert!(rest.contains("\"finish_reason\":\"length\""), "{rest}");
    assert!(rest.ends_with("data: [DONE]\n\n"));
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

/// The real binary: SIGTERM stops accepting, lets the in-flight stream
/// finish, and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_drains_and_exits_0_on_sigterm() {
    let mut server = BinaryServer::spawn(&["--drain-timeout", "20"]);
    let c = client();
    let health = c.get(server.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let body = json!({"prompt": "drain me", "max_tokens": 200, "temperature": 0, "stream": true});
    let mut r = c
        .post(server.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut seen = String::from_utf8_lossy(&r.chunk().await.unwrap().unwrap()).into_owned();
    server.signal("TERM");
    while let Some(bytes) = r.chunk().await.unwrap() {
        seen.push_str(&String::from_utf8_lossy(&bytes));
    }
    let chunks = sse_chunks(&seen);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(text.split(' ').count(), 200, "the whole completion arrived");
    drop(c); // close the keep-alive connection, so the workers can stop
    let status = server.wait_exit(Duration::from_secs(20)).expect("exited");
    assert_eq!(status.code(), Some(0));
}

#[test]
fn the_binary_refuses_bad_flags_at_startup() {
    for (args, needle) in [
        (
            &["serve", "--mtp", "head:/m"][..],
            "MTP is not available yet",
        ),
        (&["serve", "--mtp", "sometimes"][..], "--mtp"),
        (&["serve", "--draft-max", "0"][..], "--draft-max"),
        (&["serve", "--device", "cuda"][..], "--device cuda"),
        (&["serve", "--dtype", "f64"][..], "--dtype f64"),
        (
            &["serve", "--model", "/no/such/model"][..],
            "--model /no/such/model: not a directory",
        ),
        (
            &["serve", "--max-seqs", "128", "--step-tokens", "64"][..],
            "--step-tokens",
        ),
    ] {
        let (code, stderr) = run_binary(args);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn the_binary_generates_to_the_terminal() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "generate",
            "--embedded",
            "test",
            "--max-tokens",
            "9",
            "--temperature",
            "0",
        ])
        .arg("hello there")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run tandem generate");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.trim().split(' ').count(), 9, "{text}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("[length: 3 prompt + 9 generated tokens"));
}

/// The official `openai` Python client against the real binary.
#[test]
fn official_openai_client_end_to_end() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!("SKIP: official_openai_client_end_to_end: `python3 -c \"import openai\"` failed (pip install openai)");
        return;
    }
    let server = BinaryServer::spawn(&["--api-key", "e2e-key"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(server.url("/v1"))
        .arg("e2e-key")
        .output()
        .expect("run python3");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "openai_client.py failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("checks passed"), "{stdout}");
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

/// `tandem serve --model DIR` with a real trained checkpoint reproduces the
/// reference greedy text over HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_a_model_folder_with_reference_output() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/models/stories260k");
    let Ok(reference) = std::fs::read_to_string(format!("{dir}/reference.json")) else {
        eprintln!("SKIP: {dir} is absent");
        return;
    };
    let reference: Value = serde_json::from_str(&reference).unwrap();
    let case = &reference["prompts"][0];
    let server = BinaryServer::spawn(&["--model", dir]);
    let c = client();
    let models: Value = c
        .get(server.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "stories260k");
    let n = case["generated_ids"].as_array().unwrap().len();
    for stream in [false, true] {
        let body =
            json!({"prompt": case["text"], "max_tokens": n, "temperature": 0, "stream": stream});
        let text = if stream {
            sse_chunks(&post_stream(&c, &server.url("/v1/completions"), &body).await)
                .iter()
                .map(|c| c["choices"][0]["text"].as_str().unwrap_or("").to_string())
                .collect::<String>()
        } else {
            let (status, v) = post_json(&c, &server.url("/v1/completions"), &body).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(
                v["usage"]["prompt_tokens"],
                case["prompt_ids"].as_array().unwrap().len()
            );
            v["choices"][0]["text"].as_str().unwrap().to_string()
        };
        assert_eq!(
            text,
            case["generated_text"].as_str().unwrap(),
            "stream={stream}"
        );
    }
}
