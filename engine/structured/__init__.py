"""Grammar-constrained decoding: what a request's output must match (`Grammar`), compiled
once per grammar (`GrammarCompiler`), and the token masks each step applies (`StepMasks`)."""
