/* What the kernels' int results say beside 0 (done): -1, arguments refused (a caller's bug: the loader checks what
 * it passes); LMHEAD_NO_MEMORY, a buffer could not be had. kernels/abi.py mirrors it (NO_MEMORY): MemoryError for
 * the one, the caller's own error for the other (the row passes' callers take their torch path for either).
 * Included by every kernel that allocates. */
#ifndef LMHEAD_KERNEL_RESULTS_H
#define LMHEAD_KERNEL_RESULTS_H

#define LMHEAD_NO_MEMORY (-3)

#endif
