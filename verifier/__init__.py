"""The verifier service: the target model checking k draft tokens in one forward pass over gRPC."""
