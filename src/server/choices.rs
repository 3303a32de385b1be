//! Several choices per request: OpenAI's `n` and `best_of`, on
//! `/v1/completions` and `/v1/chat/completions` (`best_of` is part of the
//! legacy completions API; on chat it is accepted as vLLM's extension).
//!
//! A request asks for `best_of` (default `n`) choices of one prompt
//! ([`GenerateChoices`]: the prompt is prefilled once and shared, choice `i`
//! samples with `seed + i`). With `best_of` = `n` every choice is returned;
//! with `best_of` > `n` the `n` with the highest cumulative logprob (the
//! sum of their tokens' logprobs) are, best first, re-indexed from 0, and
//! the request needs no `stream` (its choices are only known at the end).
//!
//! What this module owns: the checked [`ChoiceParams`]; collecting whole
//! answers ([`collect`]: per choice its text chunks and finish, the pick
//! and the usage over every generated choice, the prompt counted once);
//! building the routes' choice objects from them. Streams of several
//! choices are [`super::sse::SseStream`]s with one formatter per choice.
//!
//! [`GenerateChoices`]: crate::request::GenerateChoices

use super::body::Fields;
use super::errors::ApiError;
use super::openai_types::{
    finish_reason, ChatChoice, ChatLogprobs, ChatMessageOut, CompletionChoice, CompletionLogprobs,
    UsageJson,
};
use crate::api::{Event, Finished, TandemError, TokenInfo};
use crate::handle::ChoiceStream;
use crate::sampler::SamplingOptions;
use crate::scheduler::Usage;
use crate::tokenizer::Tokenizer;

/// The most choices (`n` or `best_of`) this layer accepts; the library
/// further limits them to the server's sequence slots (`--max-seqs`).
pub const MAX_CHOICES: usize = 128;

/// `n` and `best_of`, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChoiceParams {
    /// Choices returned.
    pub n: usize,
    /// Choices generated (≥ `n`).
    pub best_of: usize,
}

impl Default for ChoiceParams {
    fn default() -> Self {
        Self { n: 1, best_of: 1 }
    }
}

impl ChoiceParams {
    /// Reads `n` and `best_of`; `stream` is the request's `stream`.
    pub fn parse(f: &Fields, stream: bool) -> Result<Self, ApiError> {
        let max = MAX_CHOICES as i64;
        let n = f.int_in("n", 1, max)?.unwrap_or(1) as usize;
        let best_of = f.int_in("best_of", 1, max)?.map_or(n, |b| b as usize);
        if best_of < n {
            return Err(ApiError::invalid_field(
                "best_of",
                format!("must be at least `n` ({n}), got {best_of}"),
            ));
        }
        if stream && best_of > n {
            return Err(ApiError::unsupported(
                "best_of",
                format!("cannot be streamed: best_of ({best_of}) > n ({n}) picks choices only at the end"),
            ));
        }
        Ok(Self { n, best_of })
    }

    /// One choice, generated and returned: the routes' plain path.
    pub fn is_single(&self) -> bool {
        self.best_of == 1
    }

    /// Whether choices are picked (and so need their logprobs).
    pub fn picks(&self) -> bool {
        self.best_of > self.n
    }

    /// The sampling options to generate with: picking by cumulative
    /// logprob needs every token's logprob, asked for or not (the routes
    /// only return them when the client asked).
    pub fn sampling(&self, mut sampling: SamplingOptions) -> SamplingOptions {
        if self.picks() {
            sampling.logprobs = true;
        }
        sampling
    }

    /// The library names its choice count `n`; with `best_of` > `n` the
    /// count it checked was `best_of`.
    pub fn name_field(&self, mut e: ApiError) -> ApiError {
        if self.picks() && e.param.as_deref() == Some("n") {
            e.param = Some("best_of".into());
            e.message = e.message.replace("`n`", "`best_of`");
        }
        e
    }
}

/// What one choice produced.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceOutput {
    /// Its index among the generated choices.
    pub index: usize,
    /// Its text chunks with their tokens, as the events brought them.
    pub chunks: Vec<(String, Vec<TokenInfo>)>,
    pub finished: Finished,
}

impl ChoiceOutput {
    /// The sum of its tokens' logprobs (the `best_of` criterion).
    pub fn cumulative_logprob(&self) -> f64 {
        self.chunks
            .iter()
            .flat_map(|(_, tokens)| tokens)
            .map(|t| t.logprob.map_or(f64::NEG_INFINITY, f64::from))
            .sum()
    }

    fn text(&self) -> String {
        self.chunks.iter().map(|(t, _)| t.as_str()).collect()
    }
}

/// A whole answer of several choices.
#[derive(Debug, Clone, PartialEq)]
pub struct Collected {
    /// The choices returned, in their response order.
    pub chosen: Vec<ChoiceOutput>,
    /// Over every generated choice, the prompt counted once.
    pub usage: UsageJson,
}

/// Runs every choice to its end, then picks. The first error fails the
/// whole answer (a JSON response has no place for a failed choice); the
/// stream is dropped with it, which cancels the others.
pub async fn collect(
    mut events: ChoiceStream,
    params: ChoiceParams,
) -> Result<Collected, TandemError> {
    let mut chunks: Vec<Vec<(String, Vec<TokenInfo>)>> = vec![Vec::new(); events.len()];
    let mut done: Vec<Option<ChoiceOutput>> = vec![None; events.len()];
    while let Some((i, event)) = events.next_event().await {
        match event {
            Event::Tokens { text, tokens, .. } => chunks[i].push((text, tokens)),
            Event::Finished(finished) => {
                done[i] = Some(ChoiceOutput {
                    index: i,
                    chunks: std::mem::take(&mut chunks[i]),
                    finished,
                })
            }
            Event::Error { error, .. } => return Err(error),
        }
    }
    let outputs = done
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| TandemError::Internal("a choice ended without a result".into()))?;
    let usage = total_usage(outputs.iter().map(|o| &o.finished.usage));
    Ok(Collected {
        chosen: pick_best(outputs, params.n),
        usage,
    })
}

/// The `n` outputs with the highest cumulative logprob, best first (ties
/// keep choice order); all of them, in choice order, when there are `n`.
pub fn pick_best(mut outputs: Vec<ChoiceOutput>, n: usize) -> Vec<ChoiceOutput> {
    if outputs.len() > n {
        outputs.sort_by(|a, b| b.cumulative_logprob().total_cmp(&a.cumulative_logprob()));
        outputs.truncate(n);
    }
    outputs
}

/// The usage of a request from its choices' (in choice order): the prompt
/// once (its cached part as the first choice found it: the others share
/// the first one's blocks), every choice's completion tokens.
pub fn total_usage<'a>(usages: impl IntoIterator<Item = &'a Usage>) -> UsageJson {
    let mut total: Option<Usage> = None;
    for u in usages {
        match &mut total {
            None => total = Some(*u),
            Some(t) => {
                t.completion_tokens += u.completion_tokens;
                t.draft_tokens += u.draft_tokens;
                t.accepted_draft_tokens += u.accepted_draft_tokens;
            }
        }
    }
    UsageJson::from(total.unwrap_or_default())
}

/// The completions choices of a whole answer, re-indexed in response
/// order, each after `echo` (the prompt's text, or empty).
pub fn completion_choices(
    collected: &Collected,
    logprobs: bool,
    tokenizer: &Tokenizer,
    echo: &str,
) -> Vec<CompletionChoice> {
    let build = |(index, out): (usize, &ChoiceOutput)| {
        let mut lp = CompletionLogprobs::default();
        let mut offset = echo.chars().count();
        for (text, tokens) in &out.chunks {
            if logprobs {
                lp.extend(tokenizer, tokens, offset, text);
            }
            offset += text.chars().count();
        }
        CompletionChoice {
            index,
            text: format!("{echo}{}", out.text()),
            logprobs: logprobs.then_some(lp),
            finish_reason: Some(finish_reason(out.finished.reason)),
        }
    };
    collected.chosen.iter().enumerate().map(build).collect()
}

/// The chat choices of a whole answer, re-indexed in response order.
/// `call_prefix(index)` is the call ids' prefix of each choice when the
/// request has tools to call (`None`: the text is all content).
pub fn chat_choices(
    collected: &Collected,
    logprobs: bool,
    tokenizer: &Tokenizer,
    call_prefix: impl Fn(usize) -> Option<String>,
) -> Vec<ChatChoice> {
    let build = |(index, out): (usize, &ChoiceOutput)| {
        let mut lp = ChatLogprobs::default();
        if logprobs {
            for (text, tokens) in &out.chunks {
                lp.extend(tokenizer, tokens, text);
            }
        }
        let mut finish = finish_reason(out.finished.reason);
        let (content, calls) = match call_prefix(index) {
            Some(prefix) => super::tools::parse_calls(&out.text(), &prefix),
            None => (Some(out.text()), Vec::new()),
        };
        if !calls.is_empty() {
            finish = "tool_calls";
        }
        ChatChoice {
            index,
            message: ChatMessageOut {
                role: "assistant",
                content,
                tool_calls: (!calls.is_empty()).then_some(calls),
            },
            logprobs: logprobs.then_some(lp),
            finish_reason: Some(finish),
        }
    };
    collected.chosen.iter().enumerate().map(build).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::{FinishReason, RequestId, Timings};
    use crate::server::body::parse_object;

    fn parse(json: &str) -> Result<ChoiceParams, ApiError> {
        let f = parse_object(json.as_bytes()).unwrap();
        let stream = f.get::<bool>("stream").unwrap().unwrap_or(false);
        ChoiceParams::parse(&f, stream)
    }

    #[test]
    fn n_and_best_of_are_checked_and_named() {
        assert_eq!(parse("{}").unwrap(), ChoiceParams::default());
        assert_eq!(
            parse(r#"{"n":3}"#).unwrap(),
            ChoiceParams { n: 3, best_of: 3 }
        );
        let p = parse(r#"{"n":2,"best_of":5}"#).unwrap();
        assert!(p.picks() && !p.is_single());
        assert!(p.sampling(SamplingOptions::default()).logprobs);
        assert!(parse(r#"{"n":2,"stream":true}"#).is_ok());
        let param = |json: &str| parse(json).unwrap_err().param.unwrap_or_default();
        for bad in [r#"{"n":0}"#, r#"{"n":129}"#, r#"{"n":1.5}"#, r#"{"n":"2"}"#] {
            assert_eq!(param(bad), "n", "{bad}");
        }
        assert_eq!(param(r#"{"n":3,"best_of":2}"#), "best_of");
        assert_eq!(param(r#"{"best_of":0}"#), "best_of");
        let e = parse(r#"{"best_of":2,"stream":true}"#).unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.param.as_deref()),
            (400, Some("best_of"))
        );
        // The library's `n` limit is `best_of`'s when that is what it checked.
        let limit = ApiError::invalid_field("n", "`n` must be in [1, 4]");
        assert_eq!(p.name_field(limit).param.as_deref(), Some("best_of"));
    }

    fn output(index: usize, logprobs: &[f32], completion_tokens: usize) -> ChoiceOutput {
        let tokens = logprobs
            .iter()
            .enumerate()
            .map(|(i, &lp)| TokenInfo {
                index: i,
                id: i as u32,
                logprob: Some(lp),
                top_logprobs: vec![],
            })
            .collect();
        ChoiceOutput {
            index,
            chunks: vec![(format!("c{index}"), tokens)],
            finished: Finished {
                id: RequestId(index as u64),
                reason: FinishReason::Length,
                usage: Usage {
                    prompt_tokens: 10,
                    completion_tokens,
                    cached_prompt_tokens: 3 + index,
                    ..Usage::default()
                },
                timings: Timings::default(),
                stop: None,
            },
        }
    }

    #[test]
    fn best_of_keeps_the_highest_cumulative_logprobs_best_first() {
        let outs = vec![
            output(0, &[-1.0, -1.0], 2),
            output(1, &[-0.5, -0.1], 2),
            output(2, &[-3.0], 1),
            output(3, &[-0.25, -0.25], 2),
        ];
        let picked: Vec<usize> = pick_best(outs.clone(), 2).iter().map(|o| o.index).collect();
        assert_eq!(picked, vec![3, 1]);
        let all: Vec<usize> = pick_best(outs.clone(), 4).iter().map(|o| o.index).collect();
        assert_eq!(all, vec![0, 1, 2, 3], "n = best_of keeps choice order");
        let usage = total_usage(outs.iter().map(|o| &o.finished.usage));
        assert_eq!(
            (
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.total_tokens
            ),
            (10, 7, 17),
            "the prompt once, every generated token"
        );
        assert_eq!(usage.prompt_tokens_details.cached_tokens, 3);
    }
}
