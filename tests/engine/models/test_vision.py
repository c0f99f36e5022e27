"""The image side of a LLaVA-layout checkpoint: pixels bit-equal to transformers' CLIP and
SigLIP processors (Pillow backend), encoder rows equal to transformers' image features for
CLIP and SigLIP towers, and each config or image it cannot serve refused by name."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch

from common.vision_spec import VisionConfigError, read_vision_spec
from engine.models import image_processor
from engine.models.image_processor import ImageError, ImageProcessing, image_pixels, normalize
from engine.models.vision import load_vision_encoder


def preprocess(data: bytes, processing: ImageProcessing) -> torch.Tensor:
    """What the engine hands the encoder: the held uint8 pixels, normalized."""
    return normalize(image_pixels(data, processing), processing)


def encoded(pixels: np.ndarray, mode: str, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGBA").convert(mode).save(buffer, format=fmt)
    return buffer.getvalue()


def random_rgba(seed: int, height: int, width: int) -> np.ndarray:
    return (np.random.default_rng(seed).random((height, width, 4)) * 255).astype("uint8")


@pytest.mark.parametrize(
    "height,width,mode,fmt",
    [(40, 50, "RGB", "PNG"), (97, 31, "RGBA", "PNG"), (28, 28, "L", "PNG"),
     (300, 200, "P", "PNG"), (13, 17, "RGB", "PNG"), (64, 48, "RGB", "JPEG")],
)  # fmt: skip
def test_clip_pixels_equal_transformers(height, width, mode, fmt):
    """Shortest-edge resize, center crop, rescale, normalize; other modes over white."""
    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    reference = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size=28)
    ours = ImageProcessing(28, 0, 0, 3, (28, 28), 1 / 255, reference.image_mean,
                           reference.image_std)  # fmt: skip
    data = encoded(random_rgba(height, height, width), mode, fmt)
    expected = reference(images=Image.open(io.BytesIO(data)), return_tensors="pt")
    assert torch.equal(preprocess(data, ours), expected["pixel_values"][0])


def test_siglip_pixels_equal_transformers():
    """A resize to height x width, no crop, normalized around 0.5."""
    from PIL import Image
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    reference = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    ours = ImageProcessing(None, 32, 32, 3, None, 1 / 255, (0.5,) * 3, (0.5,) * 3)
    for seed, (height, width) in enumerate([(40, 50), (100, 20), (32, 32)]):
        data = encoded(random_rgba(seed, height, width), "RGB")
        expected = reference(images=Image.open(io.BytesIO(data)), return_tensors="pt")
        assert torch.equal(preprocess(data, ours), expected["pixel_values"][0])


def test_unreadable_and_oversized_images_are_refused(monkeypatch):
    processing = ImageProcessing(28, 0, 0, 3, (28, 28), 1 / 255, (0.5,) * 3, (0.5,) * 3)
    for data in (b"", b"not an image", encoded(random_rgba(0, 40, 40), "RGB")[:60]):
        with pytest.raises(ImageError, match="not a readable image"):
            preprocess(data, processing)
    monkeypatch.setattr(image_processor, "MAX_IMAGE_PIXELS", 40 * 39)
    with pytest.raises(ImageError, match="40 x 40 pixels"):
        preprocess(encoded(random_rgba(0, 40, 40), "RGB"), processing)


def llava_checkpoint(tmp_path, tower: str, strategy: str, layers):
    import transformers

    torch.manual_seed(0)
    vision_class = {"clip": transformers.CLIPVisionConfig,
                    "siglip": transformers.SiglipVisionConfig}[tower]  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision_class(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, image_size=28, patch_size=7),
        text_config=transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, vocab_size=300),
        image_token_id=299, vision_feature_select_strategy=strategy,
        vision_feature_layer=layers,
    )  # fmt: skip
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # non-zero biases, so that their paths are compared too
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize(
    "tower,strategy,layers,num_tokens",
    [("clip", "default", -2, 16), ("clip", "full", [-1, 0], 17), ("siglip", "full", [-1, 1], 16)],
)
def test_encoder_rows_equal_transformers(tmp_path, tower, strategy, layers, num_tokens):
    """The projector's rows per image, for each tower, strategy and set of feature layers
    (``0``: the embeddings; several concatenated)."""
    model = llava_checkpoint(tmp_path, tower, strategy, layers)
    spec = read_vision_spec(json.loads((tmp_path / "config.json").read_text()), tmp_path)
    assert spec is not None and spec.tokens_per_image == num_tokens
    encoder = load_vision_encoder(tmp_path, spec, torch.device("cpu"), torch.float32)
    pixels = torch.randn(3, 3, 28, 28)
    with torch.no_grad():
        expected = model.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=layers,
            vision_feature_select_strategy=strategy,
        ).pooler_output  # fmt: skip
        got = encoder(pixels)
    torch.testing.assert_close(got, torch.stack(list(expected)), atol=1e-5, rtol=1e-5)


def test_vision_configs_it_cannot_serve_are_refused():
    base = {"architectures": ["LlavaForConditionalGeneration"], "image_token_index": 9,
            "text_config": {"hidden_size": 64}, "vision_config": {}}  # fmt: skip
    assert read_vision_spec({"architectures": ["LlamaForCausalLM"]}, "c") is None
    assert read_vision_spec(base, "c").tokens_per_image == 49  # CLIP's defaults: 224 / 32
    cases = {
        "vision_config.model_type": {"vision_config": {"model_type": "pixtral"}},
        "vision_feature_layer": {"vision_feature_layer": -14},
        "vision_feature_select_strategy": {"vision_feature_select_strategy": "pooled"},
        "image_token_id": {"image_token_index": None},
        "projector_hidden_act": {"projector_hidden_act": "relu"},
        "text_config.hidden_size": {"text_config": {}},
    }
    for key, change in cases.items():
        with pytest.raises(VisionConfigError, match=key):
            read_vision_spec({**base, **change}, "c")


@pytest.mark.parametrize(
    "height,width,mode,fmt",
    [(40, 50, "RGB", "PNG"), (97, 31, "RGB", "PNG"), (56, 56, "RGB", "PNG"),
     (300, 200, "RGB", "PNG"), (64, 48, "RGB", "JPEG")],
)  # fmt: skip
def test_gemma3_pixels_equal_transformers(model_factory, height, width, mode, fmt):
    """Gemma 3's processor as its checkpoints configure it (read from the made one's
    preprocessor_config.json): a bilinear resize to height x width, no crop, around 0.5.
    (Their ``do_convert_rgb`` is null, so transformers refuses other modes; pdserve lays
    them over white as for CLIP.)"""
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    model_dir = model_factory("gemma3_mm")
    reference = Gemma3ImageProcessorPil.from_pretrained(model_dir)
    ours = image_processor.read_image_processing(model_dir, 56)
    data = encoded(random_rgba(height, height, width), mode, fmt)
    expected = reference(images=Image.open(io.BytesIO(data)), return_tensors="pt")
    assert torch.equal(preprocess(data, ours), expected["pixel_values"][0])


def test_gemma3_encoder_rows_equal_transformers(model_factory):
    """SigLIP through its final norm, pooled 2 x 2, RMSNorm (1 + w), one matrix."""
    from transformers import AutoModelForImageTextToText

    model_dir = model_factory("gemma3_mm")
    spec = read_vision_spec(json.loads((model_dir / "config.json").read_text()), model_dir)
    assert spec is not None and spec.tokens_per_image == 16 and spec.bidirectional
    encoder = load_vision_encoder(model_dir, spec, torch.device("cpu"), torch.float32)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    pixels = torch.randn(3, 3, 56, 56)
    with torch.no_grad():
        expected = model.model.get_image_features(pixel_values=pixels).pooler_output
        got = encoder(pixels)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_gemma3_configs_it_cannot_serve_are_refused(model_factory, tmp_path):
    base = {"architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 16,
            "text_config": {"hidden_size": 64},
            "vision_config": {"model_type": "siglip_vision_model", "image_size": 56,
                              "patch_size": 7}}  # fmt: skip
    spec = read_vision_spec(base, "c")
    ids = (spec.marker_token_id, spec.image_token_id, spec.end_token_id)
    assert ids == (255999, 262144, 256000)  # Gemma3Config's defaults
    default = read_vision_spec({**base, "vision_config": None, "mm_tokens_per_image": 49}, "c")
    assert default.tower.kind == "siglip_vision_model"  # its class's default tower
    cases = {
        "must be SigLIP": {"vision_config": {"model_type": "clip_vision_model"}},
        "mm_tokens_per_image 15": {"mm_tokens_per_image": 15},  # not a square
        "mm_tokens_per_image 9": {"mm_tokens_per_image": 9},  # 3 x 3 cells of an 8 x 8 grid
    }
    for words, change in cases.items():
        with pytest.raises(VisionConfigError, match=words):
            read_vision_spec({**base, **change}, "c")
    model_dir = tmp_path / "pan-and-scan"
    model_dir.mkdir()
    config = json.loads((model_factory("gemma3_mm") / "preprocessor_config.json").read_text())
    (model_dir / "preprocessor_config.json").write_text(
        json.dumps({**config, "do_pan_and_scan": True})
    )
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        image_processor.read_image_processing(model_dir, 56)


QWEN_SIZES = [(60, 90), (200, 120), (300, 300), (56, 57), (29, 400)]


@pytest.mark.parametrize("arch,patch", [("qwen2_5_vl", 14), ("qwen3_vl", 16)])
@pytest.mark.parametrize("height,width", QWEN_SIZES)
def test_qwen_vl_pixels_and_rows_equal_transformers(model_factory, arch, patch, height, width):
    """Dynamic resolution (sizes to multiples of 28 or 32 within the pixel bounds),
    bicubic, the checkpoint's normalization: transformers' patches bit for bit. Qwen2.5-VL's
    windowed tower (windows of 2 x 2 merge groups, partial at the edges), Qwen3-VL's (its
    8 x 8 position table resized to grids smaller and larger, DeepStack rows), and the
    mergers: transformers' image features."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model_dir = model_factory(arch)
    spec = read_vision_spec(json.loads((model_dir / "config.json").read_text()),
                            model_dir / "config.json")  # fmt: skip
    reference = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    data = encoded(random_rgba(height, height, width), "RGB")
    expected = reference(images=Image.open(io.BytesIO(data)), return_tensors="pt")
    _, grid_h, grid_w = expected["image_grid_thw"][0].tolist()
    processing = image_processor.read_image_processing(model_dir, 0, spec.grid)
    pixels = preprocess(data, processing)  # [3, H, W]
    assert pixels.shape[1:] == (grid_h * patch, grid_w * patch)
    assert spec.num_tokens((width, height)) == grid_h * grid_w // 4
    # transformers' patch layout: merge groups whole, each patch twice (a still image).
    grouped = pixels.reshape(3, grid_h // 2, 2, patch, grid_w // 2, 2, patch)
    grouped = grouped.permute(1, 4, 2, 5, 0, 3, 6)
    patches = grouped[..., None, :, :].expand(*grouped.shape[:5], 2, patch, patch)
    assert torch.equal(patches.reshape(grid_h * grid_w, -1), expected["pixel_values"])
    encoder = load_vision_encoder(model_dir, spec, torch.device("cpu"), torch.float32)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        features = model.model.get_image_features(**expected)
        parts = [features.pooler_output, *(getattr(features, "deepstack_features", None) or [])]
        rows = torch.cat([torch.cat(list(p)) if isinstance(p, list | tuple) else p for p in parts],
                         dim=-1)  # fmt: skip
        assert rows.shape[-1] == spec.rows_width
        torch.testing.assert_close(encoder(pixels[None])[0], rows, atol=1e-5, rtol=1e-5)


def test_qwen2_5_vl_configs_it_cannot_serve_are_refused(tmp_path):
    base = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "image_token_id": 9,
            "text_config": {"hidden_size": 64}}  # fmt: skip
    spec = read_vision_spec(base, tmp_path / "config.json")
    assert spec.grid.max_pixels == 28 * 28 * 1280 and spec.num_tokens((448, 448)) == 256
    cases = {
        "hidden_act": {"vision_config": {"hidden_act": "gelu"}},
        "window_size": {"vision_config": {"window_size": 100}},
    }
    for key, change in cases.items():
        with pytest.raises(VisionConfigError, match=key):
            read_vision_spec({**base, **change}, tmp_path / "config.json")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    with pytest.raises(VisionConfigError, match="patch and merge sizes"):
        read_vision_spec(base, tmp_path / "config.json")


def test_qwen3_vl_configs_it_cannot_serve_are_refused(tmp_path):
    base = {"architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 9,
            "text_config": {"hidden_size": 64, "num_hidden_layers": 4}}  # fmt: skip
    spec = read_vision_spec(base, tmp_path / "config.json")
    assert spec.tower.deepstack_layers == (8, 16, 24) and spec.rows_width == 4 * 64
    cases = {
        "hidden_act": {"hidden_act": "silu"},
        "not a square": {"num_position_embeddings": 2300},
        "names no layer": {"deepstack_visual_indexes": [1, 27]},
        "4-layer language model": {"deepstack_visual_indexes": [1, 2, 3, 4, 5]},
    }
    for message, change in cases.items():
        with pytest.raises(VisionConfigError, match=message):
            read_vision_spec({**base, "vision_config": change}, tmp_path / "config.json")


# Qwen2.5-VL-7B-Instruct's config.json (transformers 4's flat layout), its vision keys.
QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 128000, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "tie_word_embeddings": False, "image_token_id": 151655, "vision_start_token_id": 151652,
    "vision_config": {
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
        "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
        "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}  # fmt: skip


def test_the_hub_config_reads_as_transformers_reads_it(tmp_path):
    """The language model is Qwen2's with M-RoPE sections; the tower 32 layers of 1280,
    windowed but in 4; 1280 x 28 x 28 pixels at most (256 tokens for 448 x 448)."""
    from engine.models.arch import arch_from_config

    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_VL_7B))
    arch = arch_from_config(QWEN2_5_VL_7B, tmp_path)
    assert arch.architecture == "Qwen2ForCausalLM" and arch.qkv_bias
    assert arch.rope.mrope_section == (16, 24, 24) and arch.rope.theta == 1e6
    assert (arch.hidden_size, arch.num_layers, arch.head_dim) == (3584, 28, 128)
    tower = arch.vision.tower
    assert (tower.num_layers, tower.hidden_size, tower.out_hidden_size) == (32, 1280, 3584)
    assert tower.full_attention_layers == (7, 15, 23, 31) and arch.vision.mrope
    assert arch.vision.num_tokens((448, 448)) == 256


def test_an_image_side_it_cannot_serve_leaves_the_text_served(model_factory, tmp_path, caplog):
    """A Gemma 3 export with pan-and-scan on, or a LLaVA tower it does not serve: the
    language model loads (as before Gemma 3's images were served) and says why images
    are not, and the router's model info agrees (image parts are then 400s)."""
    from common.vision_spec import served_vision_spec
    from engine.models.arch import read_arch_config

    gemma = tmp_path / "gemma"
    shutil.copytree(model_factory("gemma3_mm"), gemma)
    processor = json.loads((gemma / "preprocessor_config.json").read_text())
    (gemma / "preprocessor_config.json").write_text(
        json.dumps({**processor, "do_pan_and_scan": True})
    )
    raw = json.loads((gemma / "config.json").read_text())
    with pytest.raises(VisionConfigError, match="do_pan_and_scan"):
        read_vision_spec(raw, gemma / "config.json")
    arch = read_arch_config(gemma)
    assert arch.vision is None and arch.architecture == "Gemma3ForConditionalGeneration"
    assert "serving its language model for text only" in caplog.text
    llava = json.loads((model_factory("llava") / "config.json").read_text())
    llava["vision_config"]["model_type"] = "pixtral"
    assert served_vision_spec(llava, tmp_path / "config.json") is None


def test_a_checkpoint_without_its_tower_serves_text(model_factory, tmp_path, caplog):
    """A text-only export that keeps the vision-language config (Gemma 3's, here) loads
    its language model and generates, images refused, rather than failing to load."""
    from safetensors.torch import load_file, save_file

    from engine import LLM, SamplingParams
    from engine.models.arch import read_arch_config

    model_dir = tmp_path / "text-only"
    shutil.copytree(model_factory("gemma3_mm"), model_dir)
    weights = load_file(model_dir / "model.safetensors")
    kept = {name: t for name, t in weights.items() if "vision_tower" not in name
            and "multi_modal_projector" not in name}  # fmt: skip
    assert len(kept) < len(weights)
    save_file(kept, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert read_arch_config(model_dir).vision is None
    assert "holds no vision tower weights" in caplog.text
    llm = LLM(model_dir)
    (output,) = llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate([{"prompt": "<start_of_image>", "multi_modal_data": {"image": [b"x"]}}])


# Qwen3-VL-8B-Instruct's config.json as released (transformers 4.57: rope_scaling and
# rope_theta in text_config; the vision config's model_type still "qwen3_vl").
QWEN3_VL_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
    "text_config": {
        "attention_bias": False, "bos_token_id": 151643, "dtype": "bfloat16",
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 12288, "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text", "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 5000000,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                         "rope_type": "default"},
        "tie_word_embeddings": False, "vocab_size": 151936,
    },
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27,
        "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3,
        "intermediate_size": 4304, "model_type": "qwen3_vl", "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
}  # fmt: skip
# Its preprocessor_config.json.
QWEN3_VL_PROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}  # fmt: skip


def test_the_qwen3_vl_hub_config_reads_as_transformers_reads_it(tmp_path):
    """Qwen3's language model (q/k norms) with interleaved M-RoPE sections; the tower 27
    layers of 1152 with DeepStack after layers 8, 16 and 24 (rows 4 x 4096 wide); 64 to
    16384 tokens an image (256 for 512 x 512)."""
    from engine.models.arch import arch_from_config

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_VL_8B))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PROCESSOR))
    arch = arch_from_config(QWEN3_VL_8B, tmp_path)
    assert arch.architecture == "Qwen3ForCausalLM" and arch.qk_norm and not arch.qkv_bias
    assert arch.rope.mrope_section == (24, 20, 20) and arch.rope.mrope_interleaved
    assert arch.rope.theta == 5e6
    assert (arch.hidden_size, arch.num_layers, arch.head_dim) == (4096, 36, 128)
    vision = arch.vision
    assert (vision.tower.num_layers, vision.tower.hidden_size) == (27, 1152)
    assert vision.deepstack == 3 and vision.rows_width == 4 * 4096
    assert vision.num_tokens((512, 512)) == 256 and vision.num_tokens((100, 100)) == 64
    assert vision.grid.max_pixels == 16777216


def test_the_qwen3_vl_moe_hub_config_reads_as_transformers_reads_it(tmp_path):
    """Qwen3-VL-30B-A3B's: Qwen3-VL's tower before a Qwen3-MoE language model (128
    experts of 768, 8 a token, renormalized), every layer sparse."""
    from engine.models.arch import arch_from_config

    text = {**QWEN3_VL_8B["text_config"], "model_type": "qwen3_vl_moe_text",
            "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
            "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True}  # fmt: skip
    raw = {**QWEN3_VL_8B, "architectures": ["Qwen3VLMoeForConditionalGeneration"],
           "model_type": "qwen3_vl_moe", "text_config": text,
           "vision_config": {**QWEN3_VL_8B["vision_config"], "out_hidden_size": 2048}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PROCESSOR))
    arch = arch_from_config(raw, tmp_path)
    assert arch.architecture == "Qwen3VLMoeForConditionalGeneration" and arch.qk_norm
    moe = arch.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (128, 8, 768)
    assert moe.norm_topk_prob and all(moe.sparse_layers) and len(moe.sparse_layers) == 48
    assert arch.rope.mrope_interleaved and arch.vision.rows_width == 4 * 2048
