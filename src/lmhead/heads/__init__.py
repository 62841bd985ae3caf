"""The other heads on the same body: each a projection of the final hidden state [.., D].

    hidden [B,T,D] ──pooling (last | mean | cls)──▶ [B,D] ──▶ an embedding                 (pooling.py)
                                                        ──▶ ClassificationHead [K,D] + b  (classifier.py)
    (query, document) ──template──▶ last token's hidden ──▶ LM head rows yes − no, or the file's `cls.*` head
                                                                                          (reranker.py)
    texts + labels ──pooled features (cached)──▶ the head fitted with the fused loss      (train.py)

The LM head ([V,D]: every token) is one of them; a classification head keeps the body and swaps it for [K,D].
"""
