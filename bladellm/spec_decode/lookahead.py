"""``--decode_algo look_ahead``: lookahead decoding (Fu et al., 2024) with prompt lookup.

Each step a look_ahead request runs, after its own last token (the root, position P), a tree of
extra query tokens in the same forward pass:

- the verification branch: up to G guessed n-grams (each N-1 tokens at positions P+1..), first
  the continuation of the latest earlier occurrence of the sequence's last tokens (prompt
  lookup: what makes RAG and summarization fast), then the n-gram pool's entries keyed by the
  root token. Guess g's token j sees the context, the root and guess g's tokens before it.
- the lookahead branch: a Jacobi window of W columns and N-1 levels. Level 0 column 0 is the
  root; token (l, i) sits at position P + l + i and sees the context, the root, level-0 tokens
  of columns 1..i and the tokens of its own column at lower levels (the paper's mask, as in
  llama.cpp's lookahead example). The outputs of the last level give a new level; each column's
  trajectory (levels 0..N-2 plus the new token) is an n-gram added to the pool under its first
  token, and the window shifts up a level.

The tree's KV is never kept: its tokens write to the request's slots past its known tokens
(rolled back after the step) and attend through the masked (tree) path of the attention
backend; guessed tokens the target accepts are emitted and their
KV is computed as ordinary tokens in the next step. Verification is ``rejection.walk``: the
guesses are point-mass drafts.

A constrained request (structured output) proposes its first guess (prompt lookup, else the
pool's newest n-gram under the root) as a plain chain instead of a tree: the scheduler cuts it
where the grammar rejects it and every verified position is masked by the grammar after the
proposals before it. Its Jacobi window does not run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from bladellm.attention.backend import TreeAttention
from bladellm.config import SpeculativeConfig

_LOOKUP_MAX = 3  # prompt lookup matches the sequence's last 3, then 2, then 1 tokens
_POOL_PER_KEY = 16  # n-grams kept per key token (most recent first)


@dataclass
class _State:
    levels: list[list[int]]  # N-1 levels of W tokens; levels[0][0] stands for the root
    pool: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    # Laid out for the next step: root token, guesses, window tokens in tree order.
    guesses: list[list[int]] = field(default_factory=list)
    root: int = -1
    # Set by lay_out for the step that runs the tree: flat index of the root and the rows whose
    # outputs give the window's new level.
    root_flat: int = -1
    ran_window: bool = False


class LookaheadProposer:
    def __init__(self, config: SpeculativeConfig, block_size: int) -> None:
        self.W = config.look_ahead_window_size
        self.N = config.look_ahead_gram_size
        self.G = config.guess_set_size
        self.block_size = block_size
        self.states: dict[str, _State] = {}

    # ---- proposer interface ---------------------------------------------------------------------
    def draft_probs(self, req_id: str, k: int) -> None:
        return None  # point-mass proposals

    def drop(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    @property
    def window_size(self) -> int:
        """Tree tokens of the lookahead branch (level 0 column 0 is the root itself)."""
        return self.W * (self.N - 1) - 1

    def tree_size(self, st: _State) -> int:
        return sum(map(len, st.guesses)) + self.window_size

    def guesses(self, req_id: str, root_flat: int) -> tuple[list[list[int]], list[list[int]]]:
        st = self.states[req_id]
        flats, f = [], root_flat + 1
        for g in st.guesses:
            flats.append(list(range(f, f + len(g))))
            f += len(g)
        return st.guesses, flats

    # ---- laying out the tree --------------------------------------------------------------------
    def lay_out(self, sched, inputs, ib) -> None:
        qsl = inputs.attn_metadata.query_start_loc_cpu
        index = {r: i for i, r in enumerate(inputs.req_ids)}
        entries = []
        for req_id, size in sched.scheduled_spec_tree.items():
            st = self.states[req_id]
            i = index[req_id]
            end = int(qsl[i + 1])
            root_flat = end - size - 1
            st.root_flat = root_flat
            st.ran_window = True
            ids, pos, mask = self._tree(st)
            assert len(ids) == size, (len(ids), size)
            P = int(inputs.positions[root_flat])
            inputs.input_ids[root_flat + 1:end] = torch.tensor(ids)
            inputs.positions[root_flat + 1:end] = P + torch.tensor(pos)
            # slot_mapping stays as InputBatch made it: the tree's K/V land in the request's own
            # (allocated) slots past its tokens, rolled back after the step like rejected
            # proposals, so the causal kernel's pass over these rows reads written memory.
            entries.append((i, root_flat + 1, size, P + 1, mask))
        inputs.attn_metadata.tree = TreeAttention(entries)

    def _tree(self, st: _State) -> tuple[list[int], list[int], torch.Tensor]:
        """Tokens, positions relative to the root, and the [t, t] visibility mask."""
        W, N = self.W, self.N
        ids: list[int] = []
        pos: list[int] = []
        vis: list[list[int]] = []  # tree indices each token sees (itself included)
        for g in st.guesses:
            start = len(ids)
            for j, tok in enumerate(g):
                ids.append(tok)
                pos.append(1 + j)
                vis.append(list(range(start, start + j + 1)))
        cell: dict[tuple[int, int], int] = {}
        for i in range(1, W):  # level 0, columns 1..W-1
            cell[(0, i)] = len(ids)
            ids.append(st.levels[0][i])
            pos.append(i)
            vis.append([cell[(0, c)] for c in range(1, i + 1)])
        for lvl in range(1, N - 1):
            for i in range(W):
                cell[(lvl, i)] = len(ids)
                ids.append(st.levels[lvl][i])
                pos.append(lvl + i)
                vis.append([cell[(0, c)] for c in range(1, i + 1)]
                           + [cell[(m, i)] for m in range(1, lvl + 1)])
        t = len(ids)
        mask = torch.zeros((t, t), dtype=torch.bool)
        for r, cols in enumerate(vis):
            mask[r, cols] = True
        return ids, pos, mask

    def _window_out_flat(self, st: _State) -> list[int]:
        """Flat indices whose outputs are the window's next level, column by column."""
        base = st.root_flat + 1 + sum(map(len, st.guesses))
        W, N = self.W, self.N
        if N == 2:
            return [st.root_flat] + [base + i - 1 for i in range(1, W)]
        last = base + (W - 1) + (N - 3) * W
        return [last + i for i in range(W)]

    # ---- after the step: update the window and the pool, propose the next tree -------------------
    def logit_rows(self) -> dict[str, list[int]]:
        """Flat rows whose logits ``propose`` needs: the window outputs of trees run this step."""
        return {r: self._window_out_flat(st) for r, st in self.states.items() if st.ran_window}

    def propose(self, sched, inputs, ib, emitted: dict[str, list[int]],
                extra_logits: dict[str, torch.Tensor]
                ) -> tuple[dict[str, list[int]], dict[str, int]]:
        sizes: dict[str, int] = {}
        chains: dict[str, list[int]] = {}
        for req_id, toks in emitted.items():
            if not toks:
                continue
            row = ib.row_of[req_id]
            n = int(ib.num_tokens[row])
            seq = np.concatenate([ib.token_ids[row, :n], np.asarray(toks, np.int64)])
            st = self.states.get(req_id)
            if st is None:
                st = self._new_state(ib.token_ids[row, :int(ib.num_prompt_tokens[row])])
                self.states[req_id] = st
            if st.ran_window and req_id in extra_logits:
                self._update_window(st, extra_logits[req_id].argmax(-1).tolist())
            st.root = int(seq[-1])
            st.guesses = self._pick_guesses(st, seq)
            if ib.sampling.params[row].guided_decoding is not None:
                # Constrained: its first guess as a chain (the grammar masks chain positions;
                # a tree's branches would each need their own grammar states). No window runs.
                st.guesses = st.guesses[:1]
                if st.guesses:
                    chains[req_id] = list(st.guesses[0])
                continue
            sizes[req_id] = self.tree_size(st)
        for st in self.states.values():
            st.ran_window = False  # window rows are this step's flat indices only
        return chains, sizes

    def _new_state(self, prompt: np.ndarray) -> _State:
        W, N = self.W, self.N
        rng = np.random.default_rng(len(prompt))
        levels = [rng.choice(prompt, W).tolist() for _ in range(N - 1)]
        st = _State(levels=levels)
        # Prompt lookup seeds the pool: every n-gram of the prompt under its first token.
        p = prompt.tolist()
        for s in range(len(p) - N + 1):
            self._pool_add(st, p[s], tuple(p[s + 1:s + N]))
        return st

    def _pool_add(self, st: _State, key: int, gram: tuple[int, ...]) -> None:
        grams = st.pool.setdefault(key, [])
        if gram in grams:
            grams.remove(gram)
        grams.insert(0, gram)
        del grams[_POOL_PER_KEY:]

    def _update_window(self, st: _State, new: list[int]) -> None:
        N = self.N
        for i in range(self.W):
            col = [st.root if i == 0 else st.levels[0][i]]
            col += [st.levels[m][i] for m in range(1, N - 1)] + [new[i]]
            self._pool_add(st, col[0], tuple(col[1:]))
        st.levels = st.levels[1:] + [list(new)]

    def _pick_guesses(self, st: _State, seq: np.ndarray) -> list[list[int]]:
        k = self.N - 1
        guesses: list[list[int]] = []
        g = _prompt_lookup(seq, k)
        if g:
            guesses.append(g)
        for gram in st.pool.get(int(seq[-1]), ()):
            if len(guesses) >= self.G:
                break
            if list(gram) not in guesses:
                guesses.append(list(gram))
        return guesses[:self.G]


def _prompt_lookup(seq: np.ndarray, k: int) -> list[int]:
    """Continuation (up to k tokens) of the latest earlier occurrence of the sequence's last
    ``_LOOKUP_MAX`` (then fewer) tokens."""
    n = len(seq)
    for m in range(min(_LOOKUP_MAX, n - 1), 0, -1):
        suffix = seq[n - m:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:n - 1], m)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + m
            cont = seq[start:start + k]
            if len(cont):
                return cont.tolist()
    return []
