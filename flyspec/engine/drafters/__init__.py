"""Drafters: the ways of proposing draft tokens, all behind one interface (`base.Drafter`)."""
