"""Check that an expert directory belongs to the model being patched, and that the
quantization arguments a caller passes agree with the directory's meta (the authority)."""

from __future__ import annotations

from ..cache.expert_store import FileExpertStore
from ..discovery import ExpertSite, expert_dims, fingerprint, fingerprint_mismatch
from ..format import ExpertDirError, LayerLayout


def validate(
    store: FileExpertStore, sites: list[ExpertSite], model, given: dict, model_fp: dict | None
) -> None:
    """The model must be the one the directory was split from; quantization arguments,
    where given, must agree with the meta (the authority)."""
    meta = store.meta
    where = f"expert directory {meta.root}"
    if model_fp is None:
        if getattr(getattr(model, "model", None), "pipeline_size", 1) > 1:
            raise ValueError(
                "the model is pipelined: pass model_fingerprint (its fingerprint taken "
                "before pipeline), or load it with mlx_streaming.load(..., pipeline_group=)"
            )
        model_fp = fingerprint(model, sites)
    got_layers = [s.layer for s in sites]
    if set(meta.layers) < set(got_layers):
        raise ExpertDirError(
            f"the {where} holds layers {sorted(meta.layers)} of this model's "
            f"{got_layers} (a pipeline rank's share?): split the rest with "
            "python -m mlx_streaming split, or load with the same pipeline"
        )
    if got_layers != sorted(meta.layers):
        raise ExpertDirError(
            f"the model's MoE layers {got_layers} differ from the {where}'s "
            f"{sorted(meta.layers)}: it was split from another model; split this model "
            "into a new directory"
        )
    bad = fingerprint_mismatch(meta.fingerprint, model_fp)
    if bad:
        raise ExpertDirError(
            f"the {where} was split from another model (fingerprint differs in "
            f"{', '.join(bad)}); split this model into a new directory with "
            "split_model(MODEL, NEW_DIR)"
        )
    dims = (meta.dims["hidden"], meta.dims["moe_inter"])
    asked = (given["hidden"] or dims[0], given["moe_inter"] or dims[1])
    if asked != dims:
        raise ExpertDirError(
            f"hidden={asked[0]}, moe_inter={asked[1]} do not match the "
            f"{where} (hidden={dims[0]}, moe_inter={dims[1]})"
        )
    for s in sites:
        lay = meta.layers[s.layer]
        if expert_dims(s) != dims:
            raise ExpertDirError(
                f"layer {s.layer}'s experts are {expert_dims(s)}, not (hidden, moe_inter)={dims}"
            )
        if s.num_experts != lay.num_experts:
            raise ExpertDirError(
                f"layer {s.layer} has {s.num_experts} experts, the {where} {lay.num_experts}"
            )
        validate_quant(s.layer, lay, given, where)


def validate_quant(layer: int, lay: LayerLayout, given: dict, where: str) -> None:
    lpb = given["layer_proj_bits"] or {}
    for name, q in lay.quant.items():
        if layer in lpb:
            want = lpb[layer].get(name, given["bits"])
        elif given["proj_bits"] and name in given["proj_bits"]:
            want = given["proj_bits"][name]
        else:
            want = given["bits"]
        have = q.bits if q else None
        gs = given["group_size"]
        if (want is not None and want != have) or (q and gs is not None and gs != q.group_size):
            raise ExpertDirError(
                f"layer {layer} {name}: asked for bits={want}, group_size={gs} but the "
                f"{where} stores bits={have}, group_size={q.group_size if q else None} (its "
                "_split_meta.json is the authority): pass the meta's values (dims.bits, "
                "dims.group_size, proj_bits, per_layer_proj_bits) or none of them"
            )


def int_keys(d: dict | None) -> dict | None:
    """``d`` with integer keys (JSON gives layer numbers as strings)."""
    return {int(k): v for k, v in d.items()} if d else None
