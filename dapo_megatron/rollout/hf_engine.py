"""The transformers rollout engine: batched sampling on a CPU (or one GPU).

This is the embedded default where SGLang cannot run: the tests and the CPU demo. It
samples with ``transformers``' own ``generate`` (the same model implementation of each
family the converter verifies against), reports each sampled token's ``log_softmax(logits / T)``
from the raw logits ``generate`` returns, and takes weights from the actor as a stream of
HF-named buckets, all or nothing: tensors are checked and copied into a second set of
buffers as they arrive, and the two sets are swapped only when the whole model has
arrived, so a failed or partial sync leaves the previous weights serving. The second set
is kept between syncs (the engine holds two copies of the weights), so a sync copies
into memory that is already mapped instead of allocating a model's worth every step.

On the CPU a bucket's copies run on one Python thread per core, each copy single-threaded
(:func:`parallel_copy`), instead of one tensor after another with torch's intra-op
threads: for a 1.24 GB model's ~200 tensors on this project's 2-core machine, 0.113-0.122
s against 0.123-0.156 s tensor by tensor (one flat copy of the same bytes: 0.102-0.109 s).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Optional

import torch

from dapo_megatron.ckpt.mapping import ModelShape, fused_expert_param, fused_expert_view, hf_shapes
from dapo_megatron.families import DEFAULT_MODEL_TYPE, family_named
from dapo_megatron.rollout import routed_experts
from dapo_megatron.rollout.engine import Generation, RolloutEngine, SamplingParams, StreamGroup, stop_string_end
from dapo_megatron.rollout.routed_experts import RoutingRecorder
from dapo_megatron.rollout.seeds import continuation_seed
from dapo_megatron.weight_sync.bucket import SyncStats, WeightBucket, WeightSyncError

logger = logging.getLogger(__name__)


def parallel_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], pool: Optional[ThreadPoolExecutor]) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)``; on the CPU, spread over ``pool``'s
    threads in byte-balanced shares with torch's intra-op threads off meanwhile."""
    if pool is None or len(pairs) < 2 or pairs[0][0].device.type != "cpu":
        for dst, src in pairs:
            dst.copy_(src)
        return
    workers = pool._max_workers
    shares: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for dst, src in sorted(pairs, key=lambda pair: -pair[0].nbytes):
        least = loads.index(min(loads))
        shares[least].append((dst, src))
        loads[least] += dst.nbytes

    def copy_share(share):
        for dst, src in share:
            dst.copy_(src)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        list(pool.map(copy_share, [share for share in shares if share]))
    finally:
        torch.set_num_threads(threads)


def hf_config_for(model_config):
    """The transformers config of a resolved :class:`ModelConfig`, of its own family."""
    from transformers import AutoConfig

    shape = ModelShape.from_model_config(model_config)  # head_dim when the config leaves it unset
    return AutoConfig.for_model(
        model_config.family or DEFAULT_MODEL_TYPE,
        vocab_size=model_config.vocab_size,
        hidden_size=model_config.hidden_size,
        intermediate_size=model_config.ffn_hidden_size,
        num_hidden_layers=model_config.num_layers,
        num_attention_heads=model_config.num_attention_heads,
        num_key_value_heads=model_config.num_query_groups,
        head_dim=shape.head_dim,
        tie_word_embeddings=model_config.tie_word_embeddings,
        rms_norm_eps=model_config.rms_norm_eps,
        rope_theta=model_config.rope_theta,
        max_position_embeddings=model_config.max_position_embeddings,
        **_experts_of(model_config),
    )


def _experts_of(model_config) -> dict:
    """The HF config keys of a mixture-of-experts family's experts (none for dense)."""
    if not family_named(model_config.family or DEFAULT_MODEL_TYPE).moe:
        return {}
    return {
        "num_experts": model_config.num_experts,
        "num_experts_per_tok": model_config.moe_router_topk,
        "moe_intermediate_size": model_config.moe_ffn_hidden_size,
        "norm_topk_prob": model_config.moe_norm_topk_prob,
        "decoder_sparse_step": model_config.decoder_sparse_step,
        "mlp_only_layers": list(model_config.mlp_only_layers or []),
        "router_aux_loss_coef": model_config.moe_aux_loss_coeff or 0.0,
    }


def hf_eos_token_ids(hf_dir) -> tuple[int, ...]:
    """The end-of-sequence ids an HF folder declares (``config.json`` and
    ``generation_config.json``, each an id or a list): where SGLang stops besides the
    request's ``stop_token_ids``, so this engine stops there too."""
    import json
    from pathlib import Path

    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(hf_dir) / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)


class _StopOnText:
    """A ``generate`` stopping criterion: a row is done once the text of its newest tokens
    (enough of them to hold the longest of ``stop_strings``, none of the prompt's) holds
    one of them. (transformers' own ``stop_strings`` reads the tokenizer's vocabulary in a
    way not every tokenizer supports.)"""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...], prompt_width: int) -> None:
        self.tokenizer, self.stop_strings, self.prompt_width = tokenizer, stop_strings, prompt_width
        # A token holds at least one byte of text: this many tokens hold the longest string.
        self.window = max(len(stop.encode()) for stop in stop_strings) + 1

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        start = max(self.prompt_width, input_ids.shape[1] - self.window)
        texts = self.tokenizer.batch_decode(input_ids[:, start:].tolist())
        done = [any(stop in text for stop in self.stop_strings) for text in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class HFRolloutEngine(RolloutEngine):
    """Rollouts with a ``transformers`` causal LM of the model's family (``Qwen2ForCausalLM``, ...).

    Args:
        model: the HF model (its weights are replaced by :meth:`update_weights`).
        shape: the model's shape, for the list of tensors a sync must deliver.
        tokenizer: optional, to return decoded text.
        pad_token_id: id used to pad prompts in a batch (masked out; any id works).
        eos_token_ids: the model's own end-of-sequence ids (:func:`hf_eos_token_ids`): a
            response stops on these as well as on the request's ``stop_token_ids``, as
            in SGLang.
    """

    def __init__(
        self, model, shape: ModelShape, tokenizer=None, pad_token_id: int = 0, eos_token_ids: tuple[int, ...] = ()
    ) -> None:
        self.model = model.eval()
        self.eos_token_ids = tuple(eos_token_ids)
        self.shape = shape
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.released = False
        self.weight_version = 0
        self.last_sync: Optional[SyncStats] = None
        self._expected = hf_shapes(shape)
        self._params = dict(model.named_parameters())
        self._spare: dict[str, torch.Tensor] = {}
        self._session: Optional[dict] = None
        self._last_copy_seconds: Optional[float] = None  # of the last sync: its copies alone
        self._update_group = None  # the weight-update group, once joined (separate engines)
        self._stream: list[StreamGroup] = []  # streamed groups in flight
        self._stream_params: Optional[SamplingParams] = None
        threads = torch.get_num_threads()
        self._copy_pool = ThreadPoolExecutor(threads) if self.device.type == "cpu" and threads > 1 else None
        # Checkpoint name -> the model parameter holding it: itself, or (experts, in
        # transformers 5) the fused 3D parameter of its layer's experts.
        self._holder = {name: name if name in self._params else fused_expert_param(name) for name in self._expected}
        unknown = sorted(name for name, holder in self._holder.items() if holder not in self._params)
        if unknown:
            raise ValueError(f"the HF model has no parameters {unknown[:5]} that a model of this shape needs")

    @classmethod
    def from_model_config(
        cls, model_config, *, dtype=torch.float32, device="cpu", tokenizer=None, eos_token_ids: tuple[int, ...] = ()
    ) -> HFRolloutEngine:
        """An engine for a resolved :class:`ModelConfig`, with random weights until the first sync."""
        from transformers import AutoModelForCausalLM

        shape = ModelShape.from_model_config(model_config)
        model = AutoModelForCausalLM.from_config(hf_config_for(model_config)).to(device=device, dtype=dtype)
        return cls(model, shape, tokenizer=tokenizer, eos_token_ids=eos_token_ids)

    @classmethod
    def from_pretrained(cls, hf_dir, *, dtype=torch.float32, device="cpu", tokenizer=None) -> HFRolloutEngine:
        """An engine serving an HF checkpoint folder."""
        from transformers import AutoModelForCausalLM

        from dapo_megatron.config import read_hf_model_shape

        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).to(device)
        shape = ModelShape.from_model_config(read_hf_model_shape(hf_dir))
        return cls(model, shape, tokenizer=tokenizer, eos_token_ids=hf_eos_token_ids(hf_dir))

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Generation]:
        if not prompts or any(len(p) == 0 for p in prompts) or n < 1:
            raise ValueError(f"need at least one non-empty prompt and n >= 1 (got {len(prompts)} prompts, n={n})")
        rows = [prompt for prompt in prompts for _ in range(n)]
        seed = params.row_seeds[0] if params.row_seeds else params.seed
        results = []
        for i, (ids, log_probs, reason, routed) in enumerate(self._sample(rows, params, params.max_new_tokens, seed)):
            text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
            results.append(Generation(i // n, ids, log_probs, reason, text, routed_experts=routed))
        return results

    @torch.no_grad()
    def _sample(
        self, rows: list[list[int]], params: SamplingParams, max_new_tokens: int, seed: Optional[int]
    ) -> list[tuple[list[int], list[float], str, Optional[torch.Tensor]]]:
        """Up to ``max_new_tokens`` new tokens after each row, one ``generate`` call for all
        (seeded with ``seed``); each row's tokens, their sampling log-probs, why it
        stopped (``length``: the tokens ran out, not necessarily the response's limit) and,
        with ``params.return_routed_experts``, its routing record (the row's input and
        its tokens but the last; ``rollout/routed_experts.py``)."""
        from transformers import GenerationConfig

        if self.released:
            raise RuntimeError("generate() while the engine's memory is released; call resume_memory() first")
        width = max(len(p) for p in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, prompt in enumerate(rows):  # left padding: every prompt ends at the last column
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
            attention[i, width - len(prompt) :] = 1
        greedy = params.temperature == 0
        stop = list(dict.fromkeys([*params.stop_token_ids, *self.eos_token_ids]))  # SGLang's stop set
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(
                f"stop_strings={list(params.stop_strings)}: the transformers engine stops on text only with its "
                "tokenizer (give the engine one)"
            )
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else (0 if params.top_k < 0 else params.top_k),
            max_new_tokens=max_new_tokens,
            eos_token_id=stop or None,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        text_stop = {}
        if params.stop_strings:
            from transformers import StoppingCriteriaList

            text_stop["stopping_criteria"] = StoppingCriteriaList(
                [_StopOnText(self.tokenizer, params.stop_strings, width)]
            )
        recorder = RoutingRecorder(self.model, len(rows)) if params.return_routed_experts else nullcontext()
        with torch.random.fork_rng(devices=[]), recorder:
            if seed is not None:  # one generator for the whole request
                torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                generation_config=config,
                **text_stop,
            )
        new_tokens = out.sequences[:, width:].cpu()  # [rows, steps]
        temperature = 1.0 if greedy else params.temperature
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [rows, steps, vocab], raw
        log_probs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        results = []
        for i in range(len(rows)):
            tokens = new_tokens[i].tolist()
            length, reason = len(tokens), "length"
            for t, token in enumerate(tokens):
                if token in stop:
                    length, reason = t + 1, "stop"
                    break
            text_end = self._stop_string_end(tokens[:length], params.stop_strings)
            if text_end is not None:
                length, reason = text_end, "stop"
            results.append((tokens[:length], log_probs[i, :length].tolist(), reason))
        if not params.return_routed_experts:
            return [(*result, None) for result in results]
        routed = recorder.rows([len(p) for p in rows], width, [len(result[0]) for result in results])
        return [(*result, routing) for result, routing in zip(results, routed)]

    def _stop_string_end(self, tokens: list[int], stop_strings: tuple[str, ...]) -> Optional[int]:
        """:func:`stop_string_end` with this engine's tokenizer (which a request without
        stop strings may go without)."""
        return stop_string_end(self.tokenizer.decode, tokens, stop_strings) if stop_strings else None

    # ------------------------------------------------------------------ streamed generation

    def stream_add(self, groups: list[StreamGroup], params: SamplingParams) -> None:
        if self._stream and params != self._stream_params:
            raise ValueError("stream_add with other sampling parameters than the groups in flight")
        for group in groups:
            if not group.prompt_ids or not group.rows:
                raise ValueError(f"stream group {group.key}: needs a non-empty prompt and at least one row")
        self._stream_params = params
        self._stream.extend(groups)

    def stream_step(self, max_tokens: int, version: int) -> list[StreamGroup]:
        """One chunk of up to ``max_tokens`` tokens for every unfinished row, in one
        ``generate`` call (the prompt and the row's tokens so far are its input: a row
        continued after an abort, or under new weights, is prefilled again). The chunk's
        seed is the first unfinished row's own while it has no tokens yet (so a single
        chunk that covers whole responses samples what :meth:`generate` would), then a
        mix of it and its length; a row whose response reaches ``max_new_tokens`` stops
        with ``length``, one whose current turn (from ``turn_start``) holds a stop string
        stops with ``stop`` after the token that completes it."""
        params = self._stream_params
        active = [(group, row) for group in self._stream for row in group.rows if row.finish_reason is None]
        if active:
            first = active[0][1]
            seed = continuation_seed(first.seed, len(first.token_ids))
            chunk = min(max_tokens, max(params.max_new_tokens - len(row.token_ids) for _, row in active))
            inputs = [group.prompt_ids + row.token_ids for group, row in active]
            stop = {*params.stop_token_ids, *self.eos_token_ids}
            longest = max((len(text.encode()) for text in params.stop_strings), default=0)
            for (group, row), (ids, log_probs, reason, routed) in zip(
                active, self._sample(inputs, params, chunk, seed)
            ):
                room = params.max_new_tokens - len(row.token_ids)
                ids, log_probs = ids[:room], log_probs[:room]
                row.token_ids += ids
                row.log_probs += log_probs
                row.versions += [version] * len(ids)
                row.routed_experts = routed_experts.extended(row.routed_experts, routed)
                # A stop string may have begun in an earlier chunk (a token holds at least a
                # byte of text: it began at most its length in bytes before this chunk).
                start = max(row.turn_start, len(row.token_ids) - len(ids) - longest)
                text_end = self._stop_string_end(row.token_ids[start:], params.stop_strings)
                if text_end is not None:
                    keep = start + text_end
                    del row.token_ids[keep:], row.log_probs[keep:], row.versions[keep:]
                    row.finish_reason = "stop"
                elif reason == "stop" and ids and ids[-1] in stop:  # not cut off before its stop token
                    row.finish_reason = "stop"
                elif len(row.token_ids) >= params.max_new_tokens:
                    row.finish_reason = "length"
                row.routed_experts = routed_experts.cut(
                    row.routed_experts, len(group.prompt_ids) + len(row.token_ids) - 1
                )
        done = [group for group in self._stream if group.done]
        self._stream = [group for group in self._stream if not group.done]
        return done

    def stream_running(self) -> tuple[int, int]:
        running = [(g, row) for g in self._stream for row in g.rows if row.finish_reason is None]
        return len(running), sum(len(g.prompt_ids) + len(row.token_ids) for g, row in running)

    def stream_abort(self, version: int) -> list[StreamGroup]:
        unfinished, self._stream = self._stream, []
        return unfinished

    # ------------------------------------------------------------------ weights

    accepts_pieces = True

    def begin_weight_update(self) -> None:
        # staged: name -> the spare buffer being filled; filled: name -> elements written.
        self._session = {
            "start": time.perf_counter(),
            "staged": {},
            "filled": {},
            "bytes": 0,
            "buckets": 0,
            "copy_seconds": 0.0,
        }

    def load_weight_bucket(self, bucket: WeightBucket, last: bool) -> None:
        """Check a bucket of whole tensors or of pieces (one rank's shards, at their offsets)
        and copy it into the spare buffers; a later :meth:`end_weight_update` swaps them in."""
        session = self._open_session()
        staged, filled = session["staged"], session["filled"]
        try:
            copies = []
            offsets = bucket.offsets or [None] * len(bucket.tensors)
            for (name, tensor), offset in zip(bucket.tensors, offsets):
                self._check(name, tensor, filled, offset)
                holder = self._holder[name]
                spare = self._spare.get(holder)
                if spare is None:
                    spare = self._spare[holder] = torch.empty_like(self._params[holder].data)
                target = spare if holder == name else fused_expert_view({holder: spare}, name)
                for dim, (start, size) in enumerate(zip(offset or (), tensor.shape)):
                    target = target.narrow(dim, start, size)
                copies.append((target, tensor))
                staged[holder] = spare
                filled[name] = filled.get(name, 0) + tensor.numel()
            copy_start = time.perf_counter()
            parallel_copy(copies, self._copy_pool)
            session["copy_seconds"] += time.perf_counter() - copy_start
            session["bytes"] += bucket.num_bytes
        except WeightSyncError:
            self._session = None
            raise
        except Exception as exc:
            self._session = None
            raise WeightSyncError(
                f"weight stream failed after {len(staged)} tensors ({type(exc).__name__}: {exc}); "
                "the engine keeps its previous weights"
            ) from exc
        session["buckets"] += 1

    def end_weight_update(self) -> SyncStats:
        session = self._open_session()
        self._session = None
        staged = session["staged"]
        missing = sorted(
            name
            for name, shape in self._expected.items()
            if session["filled"].get(name, 0) != torch.Size(shape).numel()
        )
        if missing:
            raise WeightSyncError(
                f"partial weight sync: {len(missing)} tensors never arrived whole ({', '.join(missing[:5])}"
                f"{', ...' if len(missing) > 5 else ''}); the engine keeps its previous weights"
            )
        with torch.no_grad():
            for name, tensor in staged.items():
                # Swap the buffers: the new weights serve, the old ones are next sync's spare.
                self._spare[name] = self._params[name].data
                self._params[name].data = tensor
        self.weight_version += 1
        self._last_copy_seconds = session["copy_seconds"]
        self.last_sync = SyncStats(
            time.perf_counter() - session["start"], session["bytes"], len(staged), session["buckets"]
        )
        return self.last_sync

    def abort_weight_update(self) -> None:
        self._session = None

    # ------------------------------------------------------------------ weights by broadcast

    def join_weight_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str
    ) -> None:
        """Join the separate group a trainer-side sender broadcasts weights over (the same
        protocol as SGLang's engines: gloo on a CPU, NCCL on a GPU)."""
        from dapo_megatron.weight_sync.update_group import init_weight_update_group

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._update_group = init_weight_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend=backend
        )

    def receive_broadcast_bucket(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, last: bool
    ) -> None:
        """Receive one announced bucket by broadcast from rank 0 (SGLang's receive loop) and
        stage it into the open update."""
        import torch.distributed as dist

        if self._update_group is None:
            raise WeightSyncError(f"receive_broadcast_bucket before joining the weight-update group {group_name!r}")
        tensors = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            dist.broadcast(tensor, src=0, group=self._update_group)
            tensors.append((name, tensor))
        self.load_weight_bucket(WeightBucket(tensors), last)

    def _open_session(self) -> dict:
        if self._session is None:
            raise WeightSyncError(
                "a weight bucket arrived outside an update session (begin_weight_update() first); "
                "the engine keeps its previous weights"
            )
        return self._session

    def _check(self, name: str, tensor: torch.Tensor, filled: dict, offset=None) -> None:
        if name not in self._expected:
            raise WeightSyncError(f"weight sync sent unknown tensor {name!r}; the engine keeps its previous weights")
        full = tuple(self._expected[name])
        if offset is not None:
            inside = len(offset) == len(full) == tensor.dim() and all(
                0 <= start and start + size <= extent for start, size, extent in zip(offset, tensor.shape, full)
            )
            if not inside:
                raise WeightSyncError(
                    f"weight sync sent a piece of {name!r} of shape {tuple(tensor.shape)} at {tuple(offset)}, outside "
                    f"its shape {full}; the engine keeps its previous weights"
                )
            if filled.get(name, 0) + tensor.numel() > torch.Size(full).numel():
                raise WeightSyncError(
                    f"weight sync sent more of {name!r} than its {torch.Size(full).numel()} elements (a piece twice); "
                    "the engine keeps its previous weights"
                )
            return
        if name in filled:
            raise WeightSyncError(f"weight sync sent {name!r} twice; the engine keeps its previous weights")
        if tuple(tensor.shape) != tuple(self._expected[name]):
            raise WeightSyncError(
                f"weight sync sent {name!r} with shape {tuple(tensor.shape)}, expected {tuple(self._expected[name])}; "
                "the engine keeps its previous weights"
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The served weights by HF name (detached references)."""
        return {
            name: self._params[name].detach() if holder == name else fused_expert_view(self._params, name).detach()
            for name, holder in self._holder.items()
        }

    # ------------------------------------------------------------------ memory and health

    def release_memory(self) -> None:
        self._spare.clear()
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.released = True

    def resume_memory(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
        self.released = False

    def health(self) -> dict:
        return {
            "ok": not self.released,
            "engine": "hf",
            "device": str(self.device),
            "released": self.released,
            "weight_version": self.weight_version,
            "last_sync_seconds": self.last_sync.seconds if self.last_sync else None,
            "last_sync_copy_seconds": self._last_copy_seconds,
        }
