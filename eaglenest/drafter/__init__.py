"""EAGLE-3 drafter: model (SGLang-exact), draft vocabulary, TTT training, checkpoints, exports, vocabulary trims."""
