"""Committed token history with a rolling hash of every prefix.

Servers and the coordinator each keep one per session. Comparing (length, hash) of a prefix lets a server detect that the
tokens it caches are not the coordinator's (a restarted server, a failed-over session, a lost reply) without the
coordinator resending the whole context on every call.
"""

from __future__ import annotations

from collections.abc import Iterable

_MASK = (1 << 64) - 1
_MULTIPLIER = 0x100000001B3  # FNV-1a 64-bit prime: cheap, well-mixed for a polynomial rolling hash
EMPTY_HASH = 0xCBF29CE484222325  # FNV-1a 64-bit offset basis: the hash of the empty history


def extend_hash(prefix_hash: int, token: int) -> int:
    """Hash of (prefix + [token]) given the prefix's hash; +1 keeps token 0 from being a no-op."""
    return ((prefix_hash ^ (token + 1)) * _MULTIPLIER) & _MASK


def history_hash(tokens: Iterable[int]) -> int:
    h = EMPTY_HASH
    for token in tokens:
        h = extend_hash(h, token)
    return h


class ResyncRequired(Exception):
    """The server's cached history is not a prefix the client can build on: the client must resend everything."""


class TokenHistory:
    """A list of committed token ids plus hashes[i] = hash of tokens[:i] for every prefix length i."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._hashes: list[int] = [EMPTY_HASH]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def hash_at(self, length: int) -> int:
        return self._hashes[length]

    @property
    def hash(self) -> int:
        return self._hashes[-1]

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            self._hashes.append(extend_hash(self._hashes[-1], int(token)))

    def truncate(self, length: int) -> None:
        del self.tokens[length:]
        del self._hashes[length + 1:]

    def apply_sync(self, base_length: int, base_hash: int, new_tokens: Iterable[int]) -> None:
        """Make this history equal to the client's: our first base_length tokens followed by new_tokens.

        Accepting base_length < len(self) (after checking its hash) lets a retried call whose first attempt already
        committed on the server continue without a full resend.
        """
        if base_length > len(self.tokens) or self._hashes[base_length] != base_hash:
            raise ResyncRequired(
                f"server holds {len(self.tokens)} tokens, client builds on {base_length} with a different hash"
                if base_length <= len(self.tokens) else
                f"server holds {len(self.tokens)} tokens, client expects {base_length}")
        self.truncate(base_length)
        self.extend(new_tokens)
