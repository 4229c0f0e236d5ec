"""After pretraining: a trained model loaded for use, the HTTP server, and what a release is judged
and handed on with. Pretraining never imports it."""
