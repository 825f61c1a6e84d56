"""The graph llama.cpp's mtmd/clip builds to encode one image with a SigLIP tower and Gemma 3's projector.

tools/mtmd/models/siglip.cpp (clip_graph_siglip::build) over clip.cpp's build_inp, build_vit, build_attn and
build_ffn, op for op and in the same order (build_attn first orders Q, K and V into the graph), so that
ggml_graph.compute_buffer walks what ggml's allocator walks:

    image [side, side, 3] -> conv 2d (patch) + bias + position embeddings            -> [hidden, P]
    depth × ( layer norm -> q, k, v (+ biases) -> attention -> out (+ bias) -> + residual
              layer norm -> up (+ bias) -> gelu -> down (+ bias) -> + residual )
    layer norm -> average pool of merge × merge patches -> rms norm × soft_emb_norm -> × input_projection

Attention without flash attention is kq = k·q [P, P, heads] f32, its soft_max (in place) and v·kq; with it,
k and v are cast to f16 and ggml_flash_attn_ext returns [hidden, P] directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import ggml_graph as g


@dataclass(frozen=True)
class SiglipShape:
    """What the graph's sizes depend on (clip.vision.* and the tensor types of the mmproj GGUF)."""

    depth: int
    hidden: int
    heads: int
    ffn: int
    patch: int
    image_side: int          # the warm-up image: clip's image_size
    pool: int                # Gemma 3's n_merge (4; a converted test tower may set clip.vision.projector.scale_factor)
    text_hidden: int         # the language model's width (mm.input_projection)
    patch_type: str = "f32"  # v.patch_embd.weight (the converter keeps embeddings f32)
    projection_type: str = "f16"   # mm.input_projection.weight (the converter forces f16)


def gemma3_graph(s: SiglipShape, flash_attn: bool) -> g.Graph:
    graph = g.Graph()
    side = s.image_side // s.patch
    n_pos, d_head = side * side, s.hidden // s.heads
    h = s.hidden

    def linear(x: g.Tensor, rows: int, cols: int) -> g.Tensor:
        return g.same("add", g.mul_mat(g.weight((cols, rows)), x), g.weight((rows,)))

    def layer_norm(x: g.Tensor) -> g.Tensor:
        return g.same("add", g.same("mul", g.same("norm", x), g.weight((h,))), g.weight((h,)))

    # build_inp: the patch embedding
    raw = g.input_tensor((s.image_side, s.image_side, 3, 1))          # inp_raw, f32 [side, side, 3]
    x = g.conv_2d(g.weight((s.patch, s.patch, 3, h), s.patch_type), raw, s.patch)
    x = g.cont(g.transpose(g.reshape(x, n_pos, h, 1)))                 # [hidden, P]
    x = g.same("add", x, g.weight((h,)))                       # patch bias
    x = g.same("add", x, g.weight((h, n_pos)))                 # learned position embeddings
    residual = g.reshape(x, h, n_pos)
    for _ in range(s.depth):
        cur = layer_norm(residual)
        q, k, v = (g.reshape(linear(cur, h, h), d_head, s.heads, n_pos, 1) for _ in range(3))   # [d_head, heads, P]
        for t in (q, k, v):
            graph.expand(t)                                            # build_attn's ggml_build_forward_order
        q, k = g.permute(q, 0, 2, 1, 3), g.permute(k, 0, 2, 1, 3)
        if flash_attn:
            k, v = g.cast(k, "f16"), g.cast(g.permute(v, 0, 2, 1, 3), "f16")
            att = g.reshape(g.flash_attn_ext(q, k, v), h, n_pos)            # [hidden, P]
        else:
            v = g.cont(g.permute(v, 1, 2, 0, 3))
            kq = g.same("soft_max", g.mul_mat(k, q))                        # f32 [P, P, heads], in place
            att = g.cont(g.permute(g.mul_mat(v, kq), 0, 2, 1, 3), h, n_pos)  # [hidden, P]
        x = g.same("add", linear(att, h, h), residual)
        cur = layer_norm(x)
        up = g.same("unary", linear(cur, s.ffn, h))                        # gelu, [ffn, P]
        cur = g.same("add", g.mul_mat(g.weight((s.ffn, h)), up), g.weight((h,)))
        residual = g.same("add", x, cur)
    x = g.reshape(layer_norm(residual), h, n_pos, 1)
    # Gemma 3's projector: average pool, rms norm, projection
    x = g.pool_2d(g.cont(g.transpose(x), side, side, h, 1), s.pool)   # [side / pool, side / pool, hidden]
    x = g.cont(g.transpose(g.reshape(x, x.ne[0] * x.ne[0], h, 1)))      # [hidden, tokens]
    x = g.same("mul", g.same("rms_norm", x), g.weight((h,)))
    x = g.mul_mat(g.cont(g.transpose(g.weight((s.text_hidden, h), s.projection_type))), x)   # [text_hidden, tokens]
    graph.expand(x)
    return graph
