"""The decoding loop: options and results, the Decoder and Drafter protocols, sampling and
the acceptance rule, counters, token history."""
