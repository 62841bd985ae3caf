"""lmhead's C kernels, the ground floor: they import nothing of the floors above.

    coded_kernel.c     the product over GGUF codes (models/coded_linear.py), and the screen of the head
    body_kernels.c     norms, the gated activation, one layer's attention (models/lean.py's step-by-step path)
    decode_kernels.c   the whole decode step in one call (`lmhead_step`, `lmhead_decode`; models/lean.py)
    row_kernels.c      the decode loop's passes over rows of logits (scores, greedy, top-p, a draw, top-k)
    step_kernels.c     the declared sampler steps' float64 passes over a row (sampling/steps/moments.py)
    *.h                what the sources share: simd_math.h (the vector exp), body_kernels.h, decode_kernels.h
                       row_pieces.h (how a pass over a row is cut for the threads: by its width alone),
                       kernel_results.h (what a kernel's int result says: refused, or no memory)

`builder` compiles them once per machine into one library in the cache (no torch: `load_model` starts it before
the slow imports); `native` loads it with ctypes, self-tests every entry point and wraps the row passes. This
package's `__init__` imports neither, so that importing the builder imports no torch.
"""
