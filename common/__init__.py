"""What more than one service uses: the GPU inventory model (`inventory`), the GPU topology
(`topology`) and content addressing (`content`). Plain values and pure functions; it imports
none of the services, so the broker and the node daemon never import each other."""
