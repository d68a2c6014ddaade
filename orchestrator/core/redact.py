"""Redacting secrets before a value is printed, logged or written to disk.

Two rules, applied together:
  - by key: a mapping value whose key looks secret (`HF_TOKEN`, `api_key`,
    `db_password`, `client_secret`, `auth`, `credentials`, ...) is replaced by
    `REDACTED`, whatever it holds;
  - by shape: a string that looks like a credential (GitHub/Hugging Face/Slack/
    OpenAI-style tokens, AWS access key ids, JWTs, `Bearer ...`, PEM private
    keys, Ray's 64-hex-digit auth token, long mixed-case random strings) is
    replaced wherever it appears, and the password in `scheme://user:pw@host`
    is blanked.

`redact(value)` walks dicts/lists (returning copies); `redact_text(text)`
scrubs free text (error messages, log lines) by shape and by `secret=value` /
`'secret': value` assignments. Neither ever raises.

Key rule: the key is split into lowercase words (`_`, `-`, `.`, camelCase);
it is secret if a word is one of `SECRET_WORDS`, or its last word is `key` or
`token` (`api_key`, `AWS_SECRET_ACCESS_KEY`, `HF_TOKEN`; not `key_size`,
`num_tokens`).

Example:
    >>> redact({"env_vars": {"HF_TOKEN": "abc", "NCCL_DEBUG": "INFO"}, "lr": 0.1})
    {'env_vars': {'HF_TOKEN': '<redacted>', 'NCCL_DEBUG': 'INFO'}, 'lr': 0.1}
    >>> redact_text("override 'model.args.api_key=hunter2': unknown key")
    "override 'model.args.api_key=<redacted>': unknown key"
"""
from __future__ import annotations

import re
from typing import Any, Mapping

__all__ = ["REDACTED", "SECRET_WORDS", "is_secret_key", "looks_like_token", "redact", "redact_text"]

REDACTED = "<redacted>"

SECRET_WORDS = frozenset({
    "secret", "secrets", "password", "passwd", "passphrase", "pwd", "credential", "credentials",
    "auth", "authorization", "apikey", "privatekey", "cookie",
})
_LAST_WORDS = frozenset({"key", "token"})

_WORD_RE = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")

# Credential shapes (each matched as a whole token of the text).
_TOKEN_PATTERNS = [
    r"gh[pousr]_[A-Za-z0-9]{20,}",                      # GitHub tokens
    r"github_pat_[A-Za-z0-9_]{20,}",
    r"glpat-[A-Za-z0-9_-]{20,}",                         # GitLab
    r"hf_[A-Za-z0-9]{20,}",                              # Hugging Face
    r"sk-[A-Za-z0-9_-]{16,}",                            # OpenAI / Anthropic style
    r"xox[abposr]-[A-Za-z0-9-]{10,}",                    # Slack
    r"(?:AKIA|ASIA)[0-9A-Z]{16}",                        # AWS access key id
    r"AIza[0-9A-Za-z_-]{35}",                            # Google API key
    r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*",  # JWT
    r"[0-9a-fA-F]{64,}",                                 # Ray auth token (secrets.token_hex(32))
]
_TOKEN_RE = re.compile(r"(?<![A-Za-z0-9_+/=-])(?:" + "|".join(_TOKEN_PATTERNS) + r")(?![A-Za-z0-9_+/=-])")
# A long random-looking string: 32+ of [A-Za-z0-9_+=-] with lower, upper and digit ('/' is left
# out so that file paths are not taken for tokens).
_RANDOM_RE = re.compile(r"(?<![A-Za-z0-9_+=-])(?=[A-Za-z0-9_+=-]*[a-z])(?=[A-Za-z0-9_+=-]*[A-Z])"
                        r"(?=[A-Za-z0-9_+=-]*[0-9])[A-Za-z0-9_+=-]{32,}(?![A-Za-z0-9_+=-])")
_BEARER_RE = re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)
_PEM_RE = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)", re.DOTALL)
_URL_CRED_RE = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@'\"]+:)([^@\s/'\"]+)(@)")

# `secret_name=value` / `secret_name = 'value'` and `'secret_name': value` in free text.
_NAME = r"[A-Za-z0-9_.\-\[\]]*"
_WORDS = (r"(?:token|secret|password|passwd|passphrase|credentials?|auth|api_?key|private_?key|"
          r"access_?key)(?![a-z])")
_VALUE = r"(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s,;'\"}\])]+)"
_ASSIGN_RE = re.compile(rf"(?i)(\b{_NAME}{_WORDS}{_NAME}\s*=\s*)({_VALUE})")
_QUOTED_KEY_RE = re.compile(rf"(?i)(['\"]{_NAME}{_WORDS}{_NAME}['\"]\s*:\s*)({_VALUE})")


def _words(key: str) -> list[str]:
    return [w.lower() for w in _WORD_RE.findall(key)]


def is_secret_key(key: Any) -> bool:
    """True if a mapping key names a secret (see the module doc for the rule).

    Example:
        >>> [is_secret_key(k) for k in ("HF_TOKEN", "apiKey", "db-password", "key_size", "num_tokens")]
        [True, True, True, False, False]
    """
    if not isinstance(key, str):
        return False
    words = _words(key)
    if not words:
        return False
    joined = "".join(words)
    return (any(w in SECRET_WORDS for w in words) or words[-1] in _LAST_WORDS
            or joined in SECRET_WORDS or joined.endswith(("apikey", "privatekey")))


def looks_like_token(text: Any) -> bool:
    """True if the whole string has a credential's shape (token, key id, JWT, PEM key, ...)."""
    if not isinstance(text, str):
        return False
    s = text.strip()
    return bool(_TOKEN_RE.fullmatch(s) or _RANDOM_RE.fullmatch(s) or _PEM_RE.match(s)
                or _BEARER_RE.fullmatch(s))


def _scrub(text: str) -> str:
    text = _PEM_RE.sub(REDACTED, text)
    text = _BEARER_RE.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    text = _URL_CRED_RE.sub(lambda m: m.group(1) + REDACTED + m.group(3), text)
    return _RANDOM_RE.sub(REDACTED, _TOKEN_RE.sub(REDACTED, text))


def redact(value: Any, key: Any = None) -> Any:
    """A copy of `value` with secrets replaced by `REDACTED` (mappings by key, strings by shape).

    `key` is the name `value` is stored under, if any: a secret-looking key
    redacts the whole value. Tuples come back as lists only where they held
    something redacted; other values come back unchanged.

    Example:
        >>> redact(["ok", "ghp_" + "a" * 36, {"password": [1, 2]}])
        ['ok', '<redacted>', {'password': '<redacted>'}]
    """
    if key is not None and is_secret_key(key) and not _empty(value):
        return REDACTED
    if isinstance(value, str):
        return _scrub(value)
    if isinstance(value, Mapping):
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [redact(v) for v in value]
        return out if isinstance(value, list) or out != list(value) else value
    return value


def redact_text(text: str) -> str:
    """Free text with credential-shaped strings and `secret=value` assignments redacted.

    Example:
        >>> redact_text("url https://bob:hunter2@example.com and {'db_password': 'x y'}")
        "url https://bob:<redacted>@example.com and {'db_password': '<redacted>'}"
    """
    if not isinstance(text, str):
        return text
    text = _ASSIGN_RE.sub(lambda m: m.group(1) + _keep_quotes(m.group(2)), text)
    text = _QUOTED_KEY_RE.sub(lambda m: m.group(1) + _keep_quotes(m.group(2)), text)
    return _scrub(text)


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, Mapping, list, tuple)) and len(value) == 0)


def _keep_quotes(value: str) -> str:
    if value[:1] in "'\"" and value[-1:] == value[:1] and len(value) >= 2:
        return value[0] + REDACTED + value[0]
    return REDACTED
