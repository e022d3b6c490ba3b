"""Running the gate: settings (options), run (plan -> register -> answer), register (the registration and
the alpha ledger's checks), session (one answering session), tune, dispatch, judging and progress."""
