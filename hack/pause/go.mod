module kubetrain.io/hack/pause

go 1.26
