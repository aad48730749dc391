"""Every way of loading weights, with no infersight call: the hooks must span each read truthfully.

Usage:
  python weights_styles.py prepare DIR   # write the files (not under launch)
  python weights_styles.py run DIR OUT.json

``prepare`` writes, for each state in (cold, warm), one file per loading style, plus a small
BERT and GPT-2 saved with ``save_pretrained`` (random weights, no hub), and two header-only
files. ``run`` loads each of them the way real code does, then runs a forward where the real
code would, and writes {"pid", "files": {style_state: path}, "memcpy_bytes_per_s"} to OUT.json.
"""

import json
import os
import sys
import time

import torch

STATES = ("cold", "warm")
STYLES = ("st_assign", "st_copy", "st_half", "pt", "ptmm", "sow", "soe", "soe_stage", "jit")
SUFFIX = {"pt": ".pt", "ptmm": ".pt", "jit": ".pt"}


def mlp() -> torch.nn.Module:
    # 12 MiB of float32: tens of MB across the styles, small enough for a shared CI machine
    return torch.nn.Sequential(torch.nn.Linear(1024, 1536), torch.nn.ReLU(), torch.nn.Linear(1536, 1024))


def memcpy_bytes_per_s() -> float:
    """This machine's best copy rate (torch's threaded copy_, a bytes copy), at the weights' size
    and larger, best of many: a shared machine is only sometimes quiet."""
    best = 0.0
    for mb, reps in ((12, 40), (64, 5)):
        src = torch.ones(mb << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        raw = bytearray(mb << 20)
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = max(best, src.numel() / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            bytes(raw)
            best = max(best, len(raw) / (time.perf_counter() - t0))
    return best


def path_of(d: str, style: str, state: str) -> str:
    return os.path.join(d, "%s_%s%s" % (style, state, SUFFIX.get(style, ".safetensors")))


def hf_dirs(d: str, state: str) -> dict:
    return {"bert": os.path.join(d, "bert_" + state), "gpt2": os.path.join(d, "gpt2_" + state)}


def prepare(d: str) -> None:
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    for state in STATES:
        model = mlp()
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        for style in STYLES:
            p = path_of(d, style, state)
            if style == "jit":
                torch.jit.save(torch.jit.script(model), p)
            elif p.endswith(".pt"):
                torch.save(sd, p)
            else:
                save_file(sd, p)
        dirs = hf_dirs(d, state)
        # 40+ MB each: the header read before the real load (8 MB of readahead here) stays a small share
        BertModel(BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
                             vocab_size=30522)).save_pretrained(dirs["bert"])
        GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=50257)).save_pretrained(dirs["gpt2"])
        for name in ("bert", "gpt2"):  # no dtype in the config: transformers reads the header (meta) first
            cfg = os.path.join(dirs[name], "config.json")
            with open(cfg) as f:
                c = json.load(f)
            c.pop("dtype", None)
            c.pop("torch_dtype", None)
            with open(cfg, "w") as f:
                json.dump(c, f)
    save_file({"w": torch.zeros(1024, 1024)}, os.path.join(d, "header_only.safetensors"))
    torch.save({"w": torch.zeros(1024, 1024)}, os.path.join(d, "header_only.pt"))


def failed_loads(d: str) -> list:
    """The errors of loads that fail: the user's own, with or without the hooks."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    missing = os.path.join(d, "missing")
    errors = []
    for bad in (lambda: torch.load(missing + ".pt"), lambda: load_file(missing + ".safetensors"),
                lambda: safe_open(missing + ".safetensors", framework="pt"), lambda: torch.jit.load(missing + ".pt")):
        try:
            bad()
            errors.append("no error")
        except Exception as e:
            errors.append("%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
    return errors


def run(d: str, out: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoModelForCausalLM

    x = torch.randn(2, 1024)
    files = {}
    with torch.no_grad():
        for state in STATES:
            p = files["st_assign_" + state] = path_of(d, "st_assign", state)
            with torch.device("meta"):
                m = mlp()
            m.load_state_dict(load_file(p), assign=True)  # params map the file: the forward reads it
            m(x)

            p = files["st_half_" + state] = path_of(d, "st_half", state)
            with torch.device("meta"):
                m = mlp()
            m.load_state_dict(load_file(p), assign=True)
            m.float()  # already float32: the tensors still map the file, nothing read
            m.half()  # the conversion reads them

            p = files["st_copy_" + state] = path_of(d, "st_copy", state)
            mlp().load_state_dict(load_file(p))  # the copy reads it

            p = files["pt_" + state] = path_of(d, "pt", state)
            mlp().load_state_dict(torch.load(p, weights_only=True))

            p = files["ptmm_" + state] = path_of(d, "ptmm", state)
            mlp().load_state_dict(torch.load(p, mmap=True, weights_only=True))

            p = files["sow_" + state] = path_of(d, "sow", state)
            with safe_open(p, framework="pt") as f:
                sd = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            mlp().load_state_dict(sd)

            p = files["soe_" + state] = path_of(d, "soe", state)
            f = safe_open(p, framework="pt")  # transformers 5 style: no `with`, slices, explicit __exit__
            sd = {k: f.get_slice(k)[:] for k in f.keys()}  # noqa: SIM118
            f.__exit__(None, None, None)
            mlp().load_state_dict(sd)

            p = files["soe_stage_" + state] = path_of(d, "soe_stage", state)
            f = safe_open(p, framework="pt")  # no `with`, and a stage (a warmup forward) before the close
            sd = {k: f.get_slice(k)[:] for k in f.keys()}  # noqa: SIM118
            mlp()(x)
            f.__exit__(None, None, None)  # a span from the open would overlap the forward: none
            mlp().load_state_dict(sd)  # the read is still spanned (deferred)

            p = files["jit_" + state] = path_of(d, "jit", state)
            torch.jit.load(p)(x)

            dirs = hf_dirs(d, state)
            files["bert_" + state] = os.path.join(dirs["bert"], "model.safetensors")
            bert = AutoModel.from_pretrained(dirs["bert"])
            bert(torch.ones(1, 8, dtype=torch.long))
            files["gpt2_" + state] = os.path.join(dirs["gpt2"], "model.safetensors")
            gpt2 = AutoModelForCausalLM.from_pretrained(dirs["gpt2"])
            gpt2.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, do_sample=False, pad_token_id=0)

        files["header_st"] = p = os.path.join(d, "header_only.safetensors")
        with safe_open(p, framework="pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
        assert shapes == {"w": [1024, 1024]}
        files["header_pt"] = p = os.path.join(d, "header_only.pt")
        assert torch.load(p, map_location="meta", weights_only=True)["w"].is_meta
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "files": files, "memcpy_bytes_per_s": memcpy_bytes_per_s(),
                   "errors": failed_loads(d)}, f)


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2])
        # the files are written and closed; skip the interpreter's teardown of torch and
        # transformers (about a second), which ``prepare`` (not run under launch) has no use for
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        run(sys.argv[2], sys.argv[3])
