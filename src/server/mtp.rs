//! MTP (multi-token prediction, speculative decoding) knobs of the server:
//! the `--mtp` / `--draft-max` flags and the `tandem` extension object of a
//! request.
//!
//! NOTE: the engine has no MTP drafter yet. Both surfaces already parse and
//! validate their values, so their syntax is fixed and documented, but any
//! mode other than `off` is refused with a clear error (a startup error for
//! the flag, a 400 naming the field for a request) instead of being ignored.
//! Wiring the drafter only has to replace [`MtpMode::ensure_available`].

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// Largest accepted `draft_max` (drafts per step per sequence).
pub const MAX_DRAFT_TOKENS: usize = 16;

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
    /// A drafting mode was asked for but the engine cannot draft yet.
    #[error("MTP is not available yet (only `off` is accepted), got `{0}`")]
    NotAvailable(String),
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
    /// Refuses every mode the engine cannot run yet (all but `off`).
    pub fn ensure_available(&self) -> Result<(), MtpError> {
        match self {
            MtpMode::Off => Ok(()),
            other => Err(MtpError::NotAvailable(other.to_string())),
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
    fn only_off_is_available() {
        assert_eq!(MtpMode::Off.ensure_available(), Ok(()));
        let e = MtpMode::EarlyExit { layers: 2 }
            .ensure_available()
            .unwrap_err();
        assert!(e.to_string().contains("MTP is not available yet"));
        assert!(check_draft_max(0).is_err() && check_draft_max(17).is_err());
        assert_eq!(check_draft_max(4), Ok(4));
    }
}
