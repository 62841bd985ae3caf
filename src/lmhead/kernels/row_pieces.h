/* How a pass over one row of V logits is cut for the threads: into pieces that depend on V alone, each piece's
 * sums computed by one thread and the pieces combined in order, so that a row's sums (its normaliser, moments,
 * nucleus and typical-set masses) are the same bits whatever the number of threads — and so whatever else is in
 * the batch, which decides how the threads are shared. A row narrower than ROW_PIECE_MIN is one piece; a wider
 * one ROW_PIECES pieces, as many at once as there are threads (up to ROW_PIECES); the decode loop's scores cut
 * rows by score_pieces.
 *
 * Included by row_kernels.c and step_kernels.c. */
#ifndef LMHEAD_ROW_PIECES_H
#define LMHEAD_ROW_PIECES_H

#include <stdint.h>

#define ROW_PIECES 8          /* the pieces of a wide row (the arrays of per-piece sums are this long) */
#define ROW_PIECE_MIN 32768   /* the narrowest row that is cut */

static inline int row_pieces(int64_t V) { return V < ROW_PIECE_MIN ? 1 : ROW_PIECES; }

/* the pieces of a row for the decode loop's scores (row_scores, row_greedy), whose pieces of B rows go to the
 * threads together: pieces of at least 16,384 logits, at most 16 */
static inline int64_t score_pieces(int64_t V) {
    const int64_t p = V / 16384;
    return p < 1 ? 1 : p > 16 ? 16 : p;
}

/* the threads a pass over `pieces` pieces runs on */
static inline int piece_threads(int pieces, int threads) {
    return threads < 1 ? 1 : threads < pieces ? threads : pieces;
}

#endif
