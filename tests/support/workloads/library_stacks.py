"""Real library stacks whose slow calls only stage rules name (rules/stages.toml).

    python library_stacks.py build DIR               models from configs, random weights, saved in DIR
    python library_stacks.py accelerate DIR          load_checkpoint_and_dispatch over sharded safetensors
    python library_stacks.py peft DIR                a LoRA adapter loaded and merged (merge_and_unload)
    python library_stacks.py diffusers DIR PORT      a diffusers pipeline behind FastAPI (uvicorn)

No infersight call and nothing downloaded: every model is built from a config here.
"""

from __future__ import annotations

import os
import sys

GPT = {"vocab_size": 256, "n_positions": 64, "n_embd": 384, "n_layer": 6, "n_head": 4, "bos_token_id": 1,
       "eos_token_id": 1}


def build(out: str) -> None:
    import torch
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**GPT)
    base = GPT2LMHeadModel(cfg).eval()
    # sharded: accelerate places the tensors of one shard after another
    base.save_pretrained(os.path.join(out, "sharded"), safe_serialization=True, max_shard_size="8MB")
    base.save_pretrained(os.path.join(out, "base"), safe_serialization=True)
    lora = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["c_attn", "c_proj", "c_fc"],
                                           init_lora_weights=False))
    lora.save_pretrained(os.path.join(out, "adapter"))
    unet = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(32, 64), down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=8)
    DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=50)).save_pretrained(
        os.path.join(out, "ddpm"))


def accelerate_stack(models: str) -> None:
    import torch
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(models, "sharded")
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # lm_head shares the embedding, which the checkpoint holds once
    model = load_checkpoint_and_dispatch(model, path, device_map={"": "cpu"}, no_split_module_classes=["GPT2Block"])
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long))
    print("accelerate: shards", len([n for n in os.listdir(path) if n.endswith(".safetensors")]))


def peft_stack(models: str) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(os.path.join(models, "base"))
    model = PeftModel.from_pretrained(base, os.path.join(models, "adapter"))
    merged = model.merge_and_unload().eval()
    with torch.no_grad():
        merged(torch.zeros(1, 8, dtype=torch.long))
    print("peft: merged", type(merged).__name__)


def diffusers_stack(models: str, port: str) -> None:
    import uvicorn

    os.environ["STACK_MODELS"] = models
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import diffusers_app

    server = uvicorn.Server(uvicorn.Config(diffusers_app.app, host="127.0.0.1", port=int(port), log_level="warning"))
    diffusers_app.on_first_request = lambda: setattr(server, "should_exit", True)
    server.run()


if __name__ == "__main__":
    mode, where = sys.argv[1], sys.argv[2]
    if mode == "build":
        build(where)
    elif mode == "accelerate":
        accelerate_stack(where)
    elif mode == "peft":
        peft_stack(where)
    elif mode == "diffusers":
        diffusers_stack(where, sys.argv[3])
    else:
        raise SystemExit("unknown mode %r" % mode)
