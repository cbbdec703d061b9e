"""The long-context stack around attention: block-input offload, tiled MLP, chunked loss."""
