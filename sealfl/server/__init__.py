"""Aggregator side: Flower ServerApp and the encrypted FedAvg strategy. Holds an HE
context WITHOUT the secret key: it adds ciphertexts and never decrypts."""
