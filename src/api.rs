//! The public request and event types: what a host service, a custom actor
//! or the HTTP layer sends to Tandem and gets back.
//!
//! A [`GenerateRequest`] is what the client said; it is checked once (prompt
//! tokenized, limits resolved, options validated, on a worker thread off
//! the scheduler's mailbox) before it takes a slot, and any problem comes
//! back as a [`TandemError`] naming the field.
//! Events for one request arrive in order: zero or more [`Event::Tokens`],
//! then exactly one terminal [`Event::Finished`] or [`Event::Error`].

use serde::{Deserialize, Serialize};

use crate::engine::SpecOptions;
use crate::sampler::SamplingOptions;
use crate::scheduler::{FinishReason, RequestId, SchedulerError, Timings, Usage};
use crate::structured::Constraint;
use crate::tokenizer::TokenizerError;

/// The prompt: text to tokenize, or token ids used as given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Self {
        Prompt::Text(s.to_string())
    }
}

impl From<String> for Prompt {
    fn from(s: String) -> Self {
        Prompt::Text(s)
    }
}

/// One completion request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    /// Most tokens to generate; `None` means "until EOS or the context is full"
    /// (capped by the service's `max_tokens_limit`).
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub sampling: SamplingOptions,
    /// Generation stops before any of these strings; the match is not sent.
    #[serde(default)]
    pub stop: Vec<String>,
    /// Speculative (MTP) decoding options; `None` uses the engine's default.
    #[serde(default)]
    pub mtp: Option<SpecOptions>,
    /// Grammar, logit bias and stop token ids (none by default).
    #[serde(default)]
    pub constraints: OutputConstraints,
}

/// What the output must follow beyond the sampling options. Checked (and
/// the grammar compiled) with the rest of the request, before it takes a
/// slot: a grammar that does not compile is an
/// [`TandemError::InvalidRequest`] naming the constraint's field.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OutputConstraints {
    /// Every generated token follows this grammar (drafts included: a draft
    /// the grammar forbids ends the draft run, and verification applies
    /// the grammar's mask at every position).
    pub grammar: Option<Constraint>,
    /// `(token id, bias)` added to the raw logits before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// Generation stops after any of these token ids (kept in the output,
    /// like an EOS).
    pub stop_token_ids: Vec<u32>,
}

impl GenerateRequest {
    /// A greedy request for `prompt` with at most `max_tokens` new tokens.
    pub fn new(prompt: impl Into<Prompt>, max_tokens: usize) -> Self {
        Self {
            prompt: prompt.into(),
            max_tokens: Some(max_tokens),
            sampling: SamplingOptions::default(),
            stop: Vec::new(),
            mtp: None,
            constraints: OutputConstraints::default(),
        }
    }

    pub fn with_sampling(mut self, sampling: SamplingOptions) -> Self {
        self.sampling = sampling;
        self
    }

    pub fn with_stop(mut self, stop: Vec<String>) -> Self {
        self.stop = stop;
        self
    }

    pub fn with_mtp(mut self, mtp: SpecOptions) -> Self {
        self.mtp = Some(mtp);
        self
    }

    pub fn with_constraints(mut self, constraints: OutputConstraints) -> Self {
        self.constraints = constraints;
        self
    }
}

/// A generated token as the client sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenInfo {
    /// Position in the completion (0 for the first generated token).
    pub index: usize,
    pub id: u32,
    /// Log-probability under the model, when the request asked for logprobs.
    pub logprob: Option<f32>,
    /// The most likely alternatives, descending, when asked for.
    pub top_logprobs: Vec<TopLogprob>,
}

/// One alternative token and its log-probability.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    pub id: u32,
    pub text: String,
    pub logprob: f32,
}

/// How a request ended, with its usage and timings.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub id: RequestId,
    pub reason: FinishReason,
    pub usage: Usage,
    pub timings: Timings,
    /// The stop string that ended generation, when one did.
    pub stop: Option<String>,
}

/// Events of one request, in order.
#[derive(Debug, Clone, PartialEq, actix::Message)]
#[rtype(result = "()")]
pub enum Event {
    /// New text and the tokens that produced it. `text` is valid UTF-8 and
    /// never contains a stop string or a prefix of one that may still match;
    /// a token whose bytes complete a character later is reported with the
    /// chunk that carries that character (so `tokens` may be empty for a
    /// chunk that only finishes earlier text, or hold several tokens).
    Tokens {
        id: RequestId,
        text: String,
        tokens: Vec<TokenInfo>,
    },
    /// Terminal: generation ended.
    Finished(Finished),
    /// Terminal: the request failed.
    Error { id: RequestId, error: TandemError },
}

impl Event {
    pub fn is_terminal(&self) -> bool {
        !matches!(self, Event::Tokens { .. })
    }

    /// The request the event belongs to (one recipient may serve many).
    pub fn id(&self) -> RequestId {
        match self {
            Event::Tokens { id, .. } | Event::Error { id, .. } => *id,
            Event::Finished(f) => f.id,
        }
    }
}

/// Errors of the public API. `error_type()` gives a fixed label for metrics
/// and error bodies; `is_invalid_request()` separates client mistakes (HTTP
/// 400) from load (429/503) and server faults (500).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TandemError {
    /// A request field is invalid; the message names it.
    #[error("invalid `{field}`: {reason}")]
    InvalidRequest { field: &'static str, reason: String },
    /// Tokenizing the prompt or decoding output failed.
    #[error("{message}")]
    Tokenizer {
        error_type: &'static str,
        message: String,
    },
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    /// The scheduler is gone (shut down or crashed).
    #[error("the scheduler is not running")]
    Unavailable,
    /// The operating system refused a thread Tandem needs (the actor
    /// thread of [`crate::TandemHandle::spawn`]); not the request's fault.
    #[error("cannot start the `{thread}` thread: {reason}")]
    ThreadSpawn {
        thread: &'static str,
        reason: String,
    },
    /// A fault inside Tandem while serving the request (a worker thread
    /// that panicked); not the request's fault.
    #[error("internal error: {0}")]
    Internal(String),
}

impl TandemError {
    pub fn error_type(&self) -> &'static str {
        match self {
            TandemError::InvalidRequest { .. } => "invalid_request",
            TandemError::Tokenizer { error_type, .. } => error_type,
            TandemError::Scheduler(e) => e.error_type(),
            TandemError::Unavailable => "unavailable",
            TandemError::ThreadSpawn { .. } => "thread_spawn",
            TandemError::Internal(_) => "internal",
        }
    }

    pub fn is_invalid_request(&self) -> bool {
        match self {
            TandemError::InvalidRequest { .. } => true,
            TandemError::Tokenizer { .. } => true,
            TandemError::Scheduler(e) => e.is_invalid_request(),
            TandemError::Unavailable
            | TandemError::ThreadSpawn { .. }
            | TandemError::Internal(_) => false,
        }
    }
}

impl From<TokenizerError> for TandemError {
    fn from(e: TokenizerError) -> Self {
        TandemError::Tokenizer {
            error_type: e.error_type(),
            message: e.to_string(),
        }
    }
}
