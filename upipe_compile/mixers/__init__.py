"""Head-separable token mixers (short convs, the gated delta rule) run over the whole sequence in UPipe stages."""
