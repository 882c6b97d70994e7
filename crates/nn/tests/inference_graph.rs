//! The inference graph shares the training graph's trunk and ends in logits.

use snug_graph::{DType, Graph, Role, TensorId};
use snug_nn::{ModelConfig, NnError};

fn models() -> Vec<ModelConfig> {
    vec![
        ModelConfig::preset("tiny").unwrap(),
        ModelConfig::preset("llama-tiny").unwrap(),
    ]
}

fn shapes(params: &[(String, TensorId)], graph: &Graph) -> Vec<(String, Vec<usize>)> {
    params
        .iter()
        .map(|(n, id)| (n.clone(), graph.tensor(*id).shape.clone()))
        .collect()
}

#[test]
fn logits_are_the_only_output_and_parameters_match_training() {
    for model in models() {
        let (batch, seq) = (2, 16);
        let inf = model.build_inference(batch, seq, 1).unwrap();
        let train = model.build(batch, seq, 1, DType::F32).unwrap();
        let g = &inf.graph;
        let logits = g.tensor(inf.logits);
        assert_eq!(logits.shape, vec![batch * seq, model.vocab_size()]);
        assert_eq!(logits.name, "logits");
        assert_eq!(g.outputs(), &[inf.logits]);
        assert_eq!(g.tensor(inf.tokens).shape, vec![batch, seq]);

        // The same parameters, by name and shape, in the same order.
        assert_eq!(shapes(&inf.params, g), shapes(&train.params, &train.graph));

        // Only the token input; no targets, no loss: one node fewer than training's forward.
        let inputs = g.tensors().iter().filter(|t| t.role == Role::Input).count();
        assert_eq!(inputs, 1, "{}", model.summary());
        assert_eq!(g.nodes().len() + 1, train.graph.nodes().len());
        assert!(g.tensors().iter().all(|t| t.name != "loss"));
    }
}

#[test]
fn inference_shapes_are_checked() {
    for model in models() {
        assert!(matches!(
            model.build_inference(0, 8, 1),
            Err(NnError::Config { field: "batch", .. })
        ));
        assert!(matches!(
            model.build_inference(1, model.max_seq() + 1, 1),
            Err(NnError::Config { field: "block", .. })
        ));
        assert!(model.build_inference(1, model.max_seq(), 1).is_ok());
    }
}
