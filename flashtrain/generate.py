"""Generate text from a language-model run (GPT-2, the Llama-style model: any model that defines generate()):
`python -m flashtrain.generate RUN_OR_CHECKPOINT --prompt "def "`.

The prompt is read once; each new token attends to the KV cache of the tokens before it through flashtrain's attention
(query length 1, causal aligned to the bottom-right corner: the model's generate with use_cache). Tokens are printed as they
come; the throughput goes to stderr at the end. On a GPU the model runs in bf16 (the CUDA kernel needs fp16 / bf16);
on a CPU in fp32, through the model config's attn_impl (flash: the plain-PyTorch reference there). The checkpoint is
verified as `resume` verifies it (`flashtrain.export.load_run`): a run directory gives its newest intact checkpoint, a
damaged checkpoint named explicitly stops with a message naming the file.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from flashtrain.export import MAX_NEW_TOKENS, load_run
from flashtrain.models.gpt2 import SAMPLING
from flashtrain.train.checkpoint import DamagedCheckpointError


class TextStream:
    """Prints the text of a growing token sequence as it grows; holds back a trailing partial UTF-8 character (a
    byte-level BPE token can end mid-character)."""

    def __init__(self, tokenizer, prompt_ids: list[int], out=sys.stdout):
        self.tokenizer, self.ids, self.out = tokenizer, list(prompt_ids), out
        self.printed = len(tokenizer.decode(self.ids))

    def __call__(self, next_token: torch.Tensor) -> None:
        self.ids.append(int(next_token[0, 0]))
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtrain.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run directory (its newest checkpoint) or a checkpoint directory")
    parser.add_argument("--prompt", default="def ", help="the text to continue (default: %(default)r)")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    parser.add_argument("--temperature", type=float, default=SAMPLING["temperature"],
                        help="0: greedy (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=SAMPLING["top_k"],
                        help="sample among the k likeliest (default: %(default)s)")
    parser.add_argument("--repetition-penalty", type=float, default=SAMPLING["repetition_penalty"],
                        help="> 1: tokens already in the text are less likely; 1: none (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attn-impl", choices=("flash", "sdpa", "reference", "auto"),
                        help="override the run's model.attn_impl")
    parser.add_argument("--no-cache", action="store_true", help="re-read the whole context for every token")
    args = parser.parse_args(argv)

    try:
        run = load_run(args.run, attn_impl=args.attn_impl)
    except DamagedCheckpointError as error:
        raise SystemExit(f"python -m flashtrain.generate: {error}") from None
    if not callable(getattr(run.model, "generate", None)):  # (the model protocol: generate is optional)
        raise SystemExit(f"{args.run}: a {type(run.model).__name__} run; its model defines no generate()")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = run.model.to(device=device, dtype=dtype)
    prompt_ids = run.tokenizer(args.prompt)["input_ids"] or [run.tokenizer.eos_token_id]
    input_ids = torch.tensor([prompt_ids], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    stream = TextStream(run.tokenizer, prompt_ids)
    sys.stdout.write(args.prompt)
    start = time.perf_counter()
    model.generate(input_ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   repetition_penalty=args.repetition_penalty, generator=generator, use_cache=not args.no_cache,
                   on_token=stream)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"{args.max_new_tokens} tokens in {seconds:.2f} s: {args.max_new_tokens / seconds:.1f} tokens/s "
          f"({run.checkpoint}, {device}, attention {model.config.attn_impl}, "
          f"{'no cache' if args.no_cache else 'KV cache'})", file=sys.stderr)


if __name__ == "__main__":
    main()
