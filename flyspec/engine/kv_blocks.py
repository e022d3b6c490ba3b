"""Which KV cache blocks hold which request's tokens: blocks handed out as sequences grow, taken back when
they end, and identical prompt blocks shared between requests (prefix caching).

A block table is a plain list of block ids in position order (position p lives in block table[p //
block_size]). The model runners pass tables to the model; they never allocate.

Prefix caching (vLLM's scheme). Each full block of a prompt is named by a hash of its tokens and of every
token before it (a chain: blake2b of the previous block's hash and this block's token ids, 128 bits).
When a block's tokens are all in the cache, it is registered under that hash. A new request looks its
prompt's blocks up in order and shares the longest run found (reference counts); it computes only the
rest. The last prompt token is always computed, since its logits give the first output token, so a prompt
that is found whole shares all but its last block. Shared blocks are never written again: a request
writes only positions after its prompt's shared blocks. Blocks of generated tokens are not registered.
A registered block holds the K/V of the target and of a same-vocabulary draft model alike, so a request
that the draft model answers alone (verification="draft_only"), which fills only the draft's half of
its blocks, shares registered blocks but registers none of its own.

Freeing. A block whose last user ends goes back to the pool: a registered one stays findable as an
evictable block (least recently freed first to be reused), any other one is free at once. Allocation
takes free blocks first (lowest id first, so a lightly used cache touches little memory), then evicts.
The memory of free blocks is handed back (`add_release_hook`) when no request holds a block any more,
not as each request ends: a busy engine reuses the same low blocks request after request, and handing
their pages back at every request's end made the next request fault every page in again (about one
minor page fault per 4 KB of K/V per token: 5,800 per 1,000 tokens for SmolLM2). Memory then stays at
the most blocks in use at once while requests run, and goes back when the engine runs dry.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flyspec.engine.sequence import Sequence
    from flyspec.spec_decode.metrics import SpecDecodeStats

BLOCK_SIZE = 16
"""Positions per KV cache block (vLLM's default): the unit of allocation and of prefix sharing."""


class BlockManager:
    """Blocks of one paged KV cache (shared by the target and a same-vocabulary draft model)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        *,
        prefix_caching: bool = False,
        stats: SpecDecodeStats | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs positive sizes, got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.stats = stats
        self._release_hooks: list[Callable[[list[int]], None]] = []
        self._unreleased: set[int] = set()  # free blocks whose memory is not handed back yet
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks))  # a heap (sorted is one)
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._hashes: dict[str, list[bytes]] = {}  # per request: its prompt's full-block hashes
        self._registered: dict[str, int] = {}  # per request: leading blocks already registered

    def add_release_hook(self, hook: Callable[[list[int]], None]) -> None:
        """Call hook(blocks) with blocks that are free and unregistered once no request holds a block (a
        cache gives their memory back; engine/model_runner.py)."""
        self._release_hooks.append(hook)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request could get now (free ones and evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that no request holds but that keep a registered prompt block for reuse."""
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens positions."""
        return -(-num_tokens // self.block_size)

    def allocate(self, table: list[int], num_tokens: int) -> bool:
        """Grow `table` to cover positions 0..num_tokens-1; False (table unchanged) if that many blocks
        are not available."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            if self._free:
                block = heapq.heappop(self._free)
                self._unreleased.discard(block)  # in use again: its memory must stay
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
            self._refs[block] = 1
            table.append(block)
        return True

    def free(self, table: list[int]) -> None:
        """Drop one user from every block of `table` and empty it. The tail is freed first, so among
        registered blocks a prompt's later blocks are evicted before its earlier ones. When no request
        holds a block any more, the free blocks' memory is handed back (module docstring)."""
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)
                self._unreleased.add(block)
        table.clear()
        if self._unreleased and self.num_used_blocks == 0:
            released = sorted(self._unreleased)
            self._unreleased.clear()
            for hook in self._release_hooks:
                hook(released)

    def free_sequence(self, seq: Sequence) -> None:
        """Free a request's blocks and forget its prompt hashes."""
        self.free(seq.block_table)
        self._hashes.pop(seq.request_id, None)
        self._registered.pop(seq.request_id, None)

    def share_prefix(self, seq: Sequence) -> int:
        """Start a request that holds no blocks on the longest run of registered blocks matching its
        prompt (at most all but its last token); returns the number of tokens found (a multiple of the
        block size, 0 without prefix caching or for a request that asks for prompt logprobs, whose
        every position must be computed)."""
        assert not seq.block_table
        if not self.prefix_caching or seq.wants_prompt_logprobs:
            return 0
        hashes = self._prompt_hashes(seq)
        limit = (seq.num_prompt_tokens - 1) // self.block_size
        for h in hashes[:limit]:
            block = self._by_hash.get(h)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            seq.block_table.append(block)
        self._registered[seq.request_id] = len(seq.block_table)
        return len(seq.block_table) * self.block_size

    def first_shareable_hash(self, seq: Sequence) -> bytes | None:
        """The hash of the request's first prompt block that another request could share, or None (prefix
        caching off, prompt logprobs asked, or a prompt shorter than a block plus one token)."""
        if not self.prefix_caching or seq.wants_prompt_logprobs:
            return None
        if (seq.num_prompt_tokens - 1) // self.block_size == 0:
            return None
        return self._prompt_hashes(seq)[0]

    def registers(self, seq: Sequence) -> bool:
        """Whether the request's computed prompt blocks become shareable (prefix caching on, every position
        scored for prompt logprobs not needed, and both models' K/V written: not a draft-only request)."""
        return self.prefix_caching and not seq.wants_prompt_logprobs and not seq.params.answered_by_draft

    def is_registered(self, block_hash: bytes) -> bool:
        """Whether a block with this hash is in the cache, findable by `share_prefix`."""
        return block_hash in self._by_hash

    def count_lookup(self, seq: Sequence, found: int) -> None:
        """Count one admitted request's prefix lookup (vLLM's prefix_cache_queries / _hits, in tokens)."""
        if self.stats is not None and self.prefix_caching and not seq.wants_prompt_logprobs:
            self.stats.prefix_cache_queries += seq.num_prompt_tokens
            self.stats.prefix_cache_hits += found

    def register(self, seq: Sequence) -> None:
        """Make the request's prompt blocks whose positions are all computed findable by later requests
        (nothing for a request that does not `register`)."""
        if not self.registers(seq):
            return
        done = min(seq.num_computed, seq.num_prompt_tokens) // self.block_size
        first = self._registered.get(seq.request_id, 0)
        if done <= first:
            return
        hashes = self._prompt_hashes(seq)
        for i in range(first, done):
            block = seq.block_table[i]
            # The same prompt computed twice at once: the first block registered under a hash stays its
            # copy; the other is an ordinary block.
            if hashes[i] not in self._by_hash and block not in self._hash_of:
                self._by_hash[hashes[i]] = block
                self._hash_of[block] = hashes[i]
        self._registered[seq.request_id] = done

    def _prompt_hashes(self, seq: Sequence) -> list[bytes]:
        hashes = self._hashes.get(seq.request_id)
        if hashes is None:
            hashes = []
            parent = b""
            bs = self.block_size
            for i in range(seq.num_prompt_tokens // bs):
                tokens = array("q", seq.prompt_token_ids[i * bs : (i + 1) * bs]).tobytes()
                parent = hashlib.blake2b(parent + tokens, digest_size=16).digest()
                hashes.append(parent)
            self._hashes[seq.request_id] = hashes
        return hashes
