//! `n` and `best_of` over HTTP (issue #17 part 4): several choices of one
//! prompt, prefilled once, each equal to a single request with its derived
//! seed (`seed + index`); streams that interleave them; `best_of` picking
//! by cumulative logprob; usage summed over every generated choice.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem::api::{GenerateRequest, Prompt};
use tandem::sampler::SamplingOptions;
use tandem::scheduler::SchedulerConfig;

use super::server_support::*;

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// A 50-token prompt: three full KV blocks of 16 and two tokens.
fn prompt_ids() -> Vec<u32> {
    std::iter::once(1)
        .chain((1..50).map(|j| (j * 7 % 500 + 10) as u32))
        .collect()
}

fn texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "{v}");
            c["text"].as_str().expect("text").to_string()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_four_with_a_seed_is_reproducible_prefills_once_and_equals_single_requests() {
    let s = TestServer::ready();
    let c = client();
    let url = s.url("/v1/completions");
    let body = |n: usize, seed: u64| {
        json!({"prompt": prompt_ids(), "max_tokens": 12, "temperature": 0.9, "top_k": 40,
               "seed": seed, "n": n})
    };
    let before = s.handle().stats().await.unwrap();
    let (status, four) = post_json(&c, &url, &body(4, 7)).await;
    let after = s.handle().stats().await.unwrap();
    assert_eq!(status, 200, "{four}");
    // One prompt, then three tails of two tokens after the 48 shared.
    assert_eq!(
        after.prompt_tokens_processed - before.prompt_tokens_processed,
        50 + 3 * 2
    );
    let got = texts(&four);
    assert_eq!(got.len(), 4);
    for choice in four["choices"].as_array().unwrap() {
        assert_eq!(choice["finish_reason"], "length");
        assert!(choice["logprobs"].is_null());
    }
    assert_eq!(
        four["usage"],
        json!({"prompt_tokens": 50, "completion_tokens": 48, "total_tokens": 98,
               "prompt_tokens_details": {"cached_tokens": 0},
               "completion_tokens_details": {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}),
        "the prompt once, every choice's tokens"
    );
    for (i, text) in got.iter().enumerate() {
        let (status, one) = post_json(&c, &url, &body(1, 7 + i as u64)).await;
        assert_eq!(status, 200, "{one}");
        assert_eq!(
            &texts(&one)[0],
            text,
            "choice {i} = the request with seed 7 + {i}"
        );
    }
    assert!(got.windows(2).any(|w| w[0] != w[1]), "{got:?}");
    let (_, again) = post_json(&c, &url, &body(4, 7)).await;
    assert_eq!(texts(&again), got, "reproducible");
    // Without a seed the choices still differ.
    let (_, unseeded) = post_json(
        &c,
        &url,
        &json!({"prompt": prompt_ids(), "max_tokens": 12, "temperature": 1.0, "n": 4}),
    )
    .await;
    let free = texts(&unseeded);
    assert!(free.windows(2).any(|w| w[0] != w[1]), "{free:?}");
    assert_eq!(s.handle().stats().await.unwrap().kv_blocks_used, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_chat_choices_are_greedy_copies_or_seeded_singles() {
    let s = TestServer::ready();
    let c = client();
    let url = s.url("/v1/chat/completions");
    let body = |n: usize, extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "tell me a story"}],
                           "max_tokens": 10, "n": n, "logprobs": true});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let content = |v: &Value, i: usize| v["choices"][i]["message"]["content"].clone();
    let (status, greedy) = post_json(&c, &url, &body(3, json!({"temperature": 0}))).await;
    assert_eq!(status, 200, "{greedy}");
    let (_, single) = post_json(&c, &url, &body(1, json!({"temperature": 0}))).await;
    for i in 0..3 {
        assert_eq!(greedy["choices"][i]["index"], i);
        assert_eq!(content(&greedy, i), content(&single, 0));
        assert_eq!(
            greedy["choices"][i]["logprobs"]["content"]
                .as_array()
                .map(Vec::len),
            Some(10),
            "each choice has its own logprobs"
        );
    }
    assert_eq!(greedy["usage"]["completion_tokens"], 30);
    let seeded = json!({"temperature": 1.0, "seed": 11});
    let (_, two) = post_json(&c, &url, &body(2, seeded)).await;
    let (_, second) = post_json(&c, &url, &body(1, json!({"temperature": 1.0, "seed": 12}))).await;
    assert_eq!(content(&two, 1), content(&second, 0), "seed 11 + 1");
}

/// Chunks of a stream by choice: each chunk carries exactly one choice.
fn by_choice(chunks: &[Value]) -> BTreeMap<u64, Vec<Value>> {
    let mut out: BTreeMap<u64, Vec<Value>> = BTreeMap::new();
    for chunk in chunks {
        let choices = chunk["choices"].as_array().expect("choices");
        if choices.is_empty() {
            continue; // the usage chunk
        }
        assert_eq!(choices.len(), 1, "{chunk}");
        out.entry(choices[0]["index"].as_u64().expect("index"))
            .or_default()
            .push(choices[0].clone());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_streams_interleave_choices_each_with_its_finish_then_usage_and_one_done() {
    let s = TestServer::ready();
    let c = client();
    let body = json!({"prompt": prompt_ids(), "max_tokens": 9, "temperature": 1.0, "seed": 5,
                      "n": 3, "logprobs": 1});
    let (_, whole) = post_json(&c, &s.url("/v1/completions"), &body).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let sse = post_stream(&c, &s.url("/v1/completions"), &streamed).await;
    assert_eq!(sse.matches("[DONE]").count(), 1);
    let chunks = sse_chunks(&sse);
    let choices = by_choice(&chunks);
    assert_eq!(choices.keys().copied().collect::<Vec<_>>(), vec![0, 1, 2]);
    for (&i, parts) in &choices {
        let finishes: Vec<&Value> = parts
            .iter()
            .filter(|p| !p["finish_reason"].is_null())
            .collect();
        assert_eq!(finishes.len(), 1, "choice {i}: one finish chunk");
        assert_eq!(finishes[0]["finish_reason"], "length");
        let text: String = parts.iter().filter_map(|p| p["text"].as_str()).collect();
        assert_eq!(text, whole["choices"][i as usize]["text"], "choice {i}");
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 27);
    assert_eq!(last["usage"]["prompt_tokens"], 50);
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c.get("usage") == Some(&Value::Null)));

    // Chat: a role chunk per choice, then their deltas.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                      "temperature": 0, "n": 2, "stream": true});
    let chunks = sse_chunks(&post_stream(&c, &s.url("/v1/chat/completions"), &chat).await);
    let choices = by_choice(&chunks);
    assert_eq!(choices.len(), 2);
    for parts in choices.values() {
        assert_eq!(parts[0]["delta"]["role"], "assistant");
        assert_eq!(
            parts
                .iter()
                .filter(|p| !p["finish_reason"].is_null())
                .count(),
            1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_best_of_returns_the_highest_cumulative_logprobs() {
    let s = TestServer::ready();
    let c = client();
    let body = json!({"prompt": prompt_ids(), "max_tokens": 8, "temperature": 1.0, "seed": 3,
                      "n": 2, "best_of": 4});
    let (status, v) = post_json(&c, &s.url("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    // The library's four choices with their logprobs, ranked.
    let request = GenerateRequest {
        prompt: Prompt::Tokens(prompt_ids()),
        max_tokens: Some(8),
        sampling: SamplingOptions {
            temperature: 1.0,
            seed: Some(3),
            logprobs: true,
            ..Default::default()
        },
        stop: vec![],
        mtp: None,
        constraints: Default::default(),
    };
    let all = s.handle().complete_choices(request, 4).await.unwrap();
    let mut ranked: Vec<(f64, String)> = all
        .into_iter()
        .map(|c| {
            let c = c.unwrap();
            let lp = c.tokens.iter().map(|t| f64::from(t.logprob.unwrap())).sum();
            (lp, c.text)
        })
        .collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
    let want: Vec<String> = ranked.into_iter().take(2).map(|(_, t)| t).collect();
    assert_eq!(texts(&v), want);
    assert!(v["choices"][0]["logprobs"].is_null(), "not asked for");
    assert_eq!(
        v["usage"]["completion_tokens"], 32,
        "every generated choice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_and_best_of_bad_values_are_400s_naming_the_field() {
    let s = TestServer::start(Options {
        sched: SchedulerConfig {
            max_seqs: 4,
            ..Default::default()
        },
        ..Default::default()
    });
    let c = client();
    let cases = [
        ("/v1/completions", json!({"prompt": "x", "n": 0}), "n"),
        ("/v1/completions", json!({"prompt": "x", "n": "2"}), "n"),
        ("/v1/completions", json!({"prompt": "x", "n": 5}), "n"),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 2, "best_of": 1}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "best_of": 5}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "best_of": 2, "stream": true}),
            "best_of",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "n": 9}),
            "n",
        ),
    ];
    for (path, body, param) in cases {
        let (status, v) = post_json(&c, &s.url(path), &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    let (status, v) = post_json(
        &c,
        &s.url("/v1/completions"),
        &json!({"prompt": "x", "n": 4, "max_tokens": 2}),
    )
    .await;
    assert_eq!(
        (status, texts(&v).len()),
        (200, 4),
        "n = the slot count is fine"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_a_disconnect_cancels_every_choice_and_frees_their_blocks() {
    let s = TestServer::ready();
    let c = client();
    // Seeded, so no choice can meet an EOS by chance before the disconnect
    // (an unseeded run is a different sample every time).
    let body = json!({"prompt": prompt_ids(), "max_tokens": 500, "n": 3, "stream": true,
                      "temperature": 1.0, "seed": 11});
    let mut r = c
        .post(s.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut seen = String::new();
    while ["\"index\":0", "\"index\":1", "\"index\":2"]
        .iter()
        .any(|i| !seen.contains(i))
    {
        let chunk = r.chunk().await.unwrap().expect("more of the stream");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(r);
    let t0 = Instant::now();
    let stats = loop {
        let st = s.handle().stats().await.unwrap();
        if st.running + st.releasing == 0 || t0.elapsed() > Duration::from_secs(10) {
            break st;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert_eq!(stats.requests_cancelled, 3, "every choice");
    assert_eq!(stats.kv_blocks_used, 0);
    assert!(stats.tokens_generated < 3 * 500);
}
