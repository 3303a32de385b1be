//! MTP (multi-token prediction, speculative decoding) knobs of the server:
//! the `--mtp` / `--draft-max` flags and the `tandem` extension object of a
//! request.
//!
//! The server drafts with one head, chosen at start-up (`--mtp`), and/or
//! with prompt lookup (`--prompt-lookup`, n-gram drafts from the request's
//! own context); the draft policy picks per sequence and step. A request
//! turns drafting off or on for itself (`"tandem": {"mtp": "off" | "on"}`)
//! and may shorten its drafts (`draft_max`).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::engine::{
    DraftHead, DraftSchedule, EarlyExitDraft, MtpDraft, PromptLookup, SpecConfig, SpecOptions,
};
use crate::model::{Model, MtpHead};

/// Largest accepted `draft_max` (drafts per step per sequence).
pub const MAX_DRAFT_TOKENS: usize = crate::engine::MAX_DRAFT_TOKENS;

/// How a sequence drafts tokens ahead.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum MtpMode {
    /// No drafting: one token per step.
    #[default]
    Off,
    /// Draft with the model's own first `layers` layers (early exit).
    EarlyExit { layers: usize },
    /// Draft with a separate MTP head loaded from a folder.
    Head { dir: PathBuf },
}

/// Why an MTP setting is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MtpError {
    /// The text is not `off`, `early-exit:L` or `head:DIR`.
    #[error("expected `off`, `early-exit:L` (L >= 1 layers) or `head:DIR`, got `{0}`")]
    Syntax(String),
    /// `draft_max` out of range.
    #[error("must be in [1, {MAX_DRAFT_TOKENS}], got {0}")]
    DraftMax(usize),
    /// The draft head could not be built.
    #[error("{0}")]
    Head(String),
}

impl FromStr for MtpMode {
    type Err = MtpError;

    fn from_str(s: &str) -> Result<Self, MtpError> {
        let bad = || MtpError::Syntax(s.to_string());
        match s.split_once(':') {
            None if s == "off" => Ok(MtpMode::Off),
            Some(("early-exit", l)) => match l.parse::<usize>() {
                Ok(layers) if layers >= 1 => Ok(MtpMode::EarlyExit { layers }),
                _ => Err(bad()),
            },
            Some(("head", dir)) if !dir.is_empty() => Ok(MtpMode::Head { dir: dir.into() }),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for MtpMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MtpMode::Off => write!(f, "off"),
            MtpMode::EarlyExit { layers } => write!(f, "early-exit:{layers}"),
            MtpMode::Head { dir } => write!(f, "head:{}", dir.display()),
        }
    }
}

impl MtpMode {
    /// The draft head for `model`, or `None` for `off`.
    pub fn draft_head(&self, model: &Model) -> Result<Option<Box<dyn DraftHead>>, MtpError> {
        match self {
            MtpMode::Off => Ok(None),
            MtpMode::EarlyExit { layers } if *layers > model.config().num_layers => {
                Err(MtpError::Head(format!(
                    "early-exit:{layers}: the model has {} layers",
                    model.config().num_layers
                )))
            }
            MtpMode::EarlyExit { layers } => Ok(Some(Box::new(EarlyExitDraft { layers: *layers }))),
            MtpMode::Head { dir } => {
                let head =
                    MtpHead::from_dir(model, dir).map_err(|e| MtpError::Head(e.to_string()))?;
                Ok(Some(Box::new(MtpDraft { head })))
            }
        }
    }

    /// Engine-wide speculation settings for drafts of at most `draft_max`,
    /// with prompt lookup beside the head (or alone) when `prompt_lookup`.
    pub fn spec_config(draft_max: usize, prompt_lookup: bool) -> SpecConfig {
        let default = SpecOptions {
            enabled: true,
            initial_draft: draft_max.min(4),
            max_draft: draft_max,
            schedule: DraftSchedule::Adaptive,
        };
        // Debug builds add a test-only field; release builds have none left.
        #[allow(clippy::needless_update)]
        SpecConfig {
            default,
            prompt_lookup: prompt_lookup.then(PromptLookup::default),
            ..SpecConfig::default()
        }
    }
}

/// Checks a `draft_max` value.
pub fn check_draft_max(n: usize) -> Result<usize, MtpError> {
    if (1..=MAX_DRAFT_TOKENS).contains(&n) {
        Ok(n)
    } else {
        Err(MtpError::DraftMax(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!("off".parse(), Ok(MtpMode::Off));
        assert_eq!("early-exit:4".parse(), Ok(MtpMode::EarlyExit { layers: 4 }));
        assert_eq!(
            "head:/m/mtp".parse(),
            Ok(MtpMode::Head {
                dir: "/m/mtp".into()
            })
        );
        for bad in ["", "on", "early-exit:0", "early-exit:x", "head:", "off:1"] {
            assert!(
                matches!(bad.parse::<MtpMode>(), Err(MtpError::Syntax(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn heads_are_built_or_refused_clearly() {
        let (model, _) = crate::tiny::tiny_model_cpu(crate::tiny::TinyPreset::Test).unwrap();
        assert!(MtpMode::Off.draft_head(&model).unwrap().is_none());
        assert!(MtpMode::EarlyExit { layers: 1 }
            .draft_head(&model)
            .unwrap()
            .is_some());
        let e = MtpMode::EarlyExit { layers: 9 }
            .draft_head(&model)
            .err()
            .unwrap();
        assert!(e.to_string().contains("has 2 layers"), "{e}");
        let e = MtpMode::Head {
            dir: "/nonexistent".into(),
        }
        .draft_head(&model)
        .err()
        .unwrap();
        assert!(e.to_string().contains("mtp.safetensors"), "{e}");
        assert!(check_draft_max(0).is_err() && check_draft_max(MAX_DRAFT_TOKENS + 1).is_err());
        assert_eq!(check_draft_max(4), Ok(4));
    }
}
