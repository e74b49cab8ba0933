"""The GC-MoE operator: native API (:mod:`.api`), symmetric buffer (:mod:`.buffer`) and its region layout
(:mod:`.workspace`), operator weights (:mod:`.weights`), the token-ring model (:mod:`.ring`), the block-size and
variant rules (:mod:`.heuristics`), and the SM90 roles (:mod:`.sm90`: ``layer`` plus one host module per kernel)."""
