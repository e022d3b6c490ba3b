"""The main job, `flyspec demo`: does the gate catch a harmful setting, and is FLy within a margin of lossless
decoding? Composed from the gate's public API: the design (arms, margin, words before the first answer) in
``design``, the words at the end in ``report``; nothing of it lives inside ``flyspec.gate``."""
